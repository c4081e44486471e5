"""The boundaries between the layers, as DEVELOPERS.md states them, held by what a fresh interpreter has
loaded after an import (sys.modules), so that a boundary broken through a package's __init__ or a
function-level import shows here:
- the op references are plain PyTorch: they import without the extension qwen38_ops._C;
- loading a checkpoint, quantize="q8_0" included, uses neither the ops nor their references (its Q8_0 codec
  is qwen38_model/checkpoint/q8_0.py);
- the package never imports benchmarks/ (which is not in the wheel)."""
import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
REFERENCES = sorted(f"qwen38_ops.reference.{p.stem}" for p in (REPO / "qwen38_ops" / "reference").glob("*.py")
                    if p.stem != "__init__")


def loaded_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter started in the repository (so that benchmarks/ is importable, were
    anything to try) and return what it prints as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_references_import_without_the_extension():
    # One interpreter, the modules one at a time: the first one after which _C is loaded is the one named.
    loaded = loaded_after(f"""
        import importlib, json, sys
        for name in {["qwen38_ops.reference", *REFERENCES]!r}:
            importlib.import_module(name)
            if "qwen38_ops._C" in sys.modules:
                print(json.dumps([name]))
                break
        else:
            print(json.dumps([]))
        """)
    assert loaded == [], f"importing {loaded[0]} loads qwen38_ops._C"


@pytest.mark.parametrize("checkpoint", ["hf", "mini-q8_0.gguf"])
def test_checkpoint_loading_uses_no_ops(oracle_dir, checkpoint):
    """Every weight of the oracle's HF folder (quantized at load) and of its Q8_0 GGUF (split at load), and a
    dequantization, without a module of qwen38_ops."""
    loaded = loaded_after(f"""
        import json, sys
        import torch
        from qwen38_model.checkpoint import open_checkpoint
        from qwen38_model.checkpoint.layout import GLOBAL_PARTS, layer_parts

        checkpoint = open_checkpoint({str(oracle_dir / checkpoint)!r})
        config = checkpoint.config
        with checkpoint.loading():
            weights = [checkpoint.load(part, None, "cpu", torch.float32, "q8_0") for part in GLOBAL_PARTS]
            weights += [checkpoint.load(part, layer, "cpu", torch.float32, "q8_0")
                        for layer in range(config.num_layers + config.num_mtp_layers)
                        for part in layer_parts(config, layer)]
        weights[0].dequantize()  # the embedding: Q8_0 either way
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "qwen38_ops")))
        """)
    assert loaded == []


def test_the_package_never_imports_benchmarks():
    """Every module of qwen38_model imported (pkgutil.walk_packages): benchmarks/ is not among what they load.
    The model imports qwen38_ops for the ops, which is allowed."""
    loaded = loaded_after("""
        import importlib, json, pkgutil, sys
        import qwen38_model
        for module in pkgutil.walk_packages(qwen38_model.__path__, "qwen38_model."):
            importlib.import_module(module.name)
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "benchmarks")))
        """)
    assert loaded == []


def test_no_module_of_the_package_names_benchmarks_in_an_import():
    """Also the imports that run only when a function is called (a subcommand that puts benchmarks/ on
    sys.path and imports from it), which importing the modules does not run."""
    found = []
    for path in sorted((REPO / "qwen38_model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert found == []
