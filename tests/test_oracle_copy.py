"""The oracle's copy in tests/oracle is the project's oracle, byte for byte, where that is at hand."""
import hashlib
import pathlib

import pytest

from conftest import ORACLE, REPO

SHARED = REPO.parent / "shared" / "oracle"


def digests(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_copy_is_the_shared_oracle():
    if not (SHARED / "mini").is_dir():
        pytest.skip(f"no project oracle at {SHARED} to compare the copy with (machines outside the project)")
    assert digests(ORACLE) == digests(SHARED / "mini")
    assert (ORACLE.parent / "README.md").read_bytes() == (SHARED / "README.md").read_bytes()


def test_the_copy_is_complete():
    """What the oracle's README lists, so a partial checkout (e.g. Git LFS pointers) fails here, not later."""
    names = {"hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "mini-f32.gguf", "mini-q8_0.gguf",
             "mini-bf16.gguf", "ref.safetensors"}
    assert names <= set(digests(ORACLE))
    assert (ORACLE / "mini-q8_0.gguf").read_bytes()[:4] == b"GGUF"
