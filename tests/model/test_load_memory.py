"""Loading streams tensors one at a time: peak host memory stays under the loaded model plus ~1.2x its
largest tensor plus a fixed overhead (a 29 GB file must never be held twice)."""
import json
import subprocess
import sys

import pytest

from qwen38_model.synthetic import write_hf_checkpoint

# Big enough that holding the file twice would show (about 300 MB, largest tensor 134 MB).
CONFIG = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, vocab_size=32768)

MEASURE = r"""
import json, sys, torch
from qwen38_model import Qwen38ForCausalLM
def status(key):  # VmHWM, not ru_maxrss: a forked child's ru_maxrss inherits the parent's peak
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
before = status("VmRSS")
model = Qwen38ForCausalLM.from_pretrained(sys.argv[1], device="cpu", dtype=torch.float32)
peak = status("VmHWM")
largest = max(b.numel() * b.element_size() for b in model.buffers())
print(json.dumps(dict(before=before, peak=peak, model=model.weight_bytes(), largest=largest)))
"""


@pytest.mark.slow
def test_peak_rss_during_load(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "big", CONFIG, dtype=__import__("torch").float32, tokenizer=False)
    out = subprocess.run([sys.executable, "-c", MEASURE, str(folder)], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout)
    transient = m["peak"] - m["before"] - m["model"]
    print(f"model {m['model'] / 1e6:.0f} MB, largest tensor {m['largest'] / 1e6:.0f} MB, peak above "
          f"model {transient / 1e6:.0f} MB")
    assert m["model"] > 250e6
    assert transient <= 1.2 * m["largest"] + 64e6
