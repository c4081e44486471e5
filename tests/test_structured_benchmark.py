"""`python -m benchmarks.structured --tiny`: the structured-output benchmark on the built-in model (CPU), each mode
through the batch engine. A smoke test of the script; its figures mean nothing on the CPU."""
import json
import pathlib
import subprocess
import sys

from conftest import require

require("llguidance")  # the test extra has it: under CI=true a missing one fails rather than skips

from benchmarks.structured import TINY  # noqa: E402


def test_structured_benchmark_runs_tiny(tmp_path):
    out = tmp_path / "structured.json"
    subprocess.run([sys.executable, "-m", "benchmarks.structured", "--tiny", "--json", str(out)], check=True,
                   cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, timeout=300)
    results = json.loads(out.read_text())
    assert results["tiny"] and (results["tokens"], results["batch"]) == (TINY["tokens"], TINY["batch"])
    assert results["unconstrained"]["step_ms"] > 0 and results["constrained"]["step_ms"] > 0
    assert results["constrained"]["fill_ms"] > 0 and "fill_ms" not in results["unconstrained"]
    assert results["constrained_over_unconstrained"] > 0
