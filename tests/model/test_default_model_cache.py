"""The built-in model's cache (issue 10): a killed first build leaves a .building-* folder, removed once
stale; an emptied or damaged model folder is rebuilt, not a permanent failure; a cache path that cannot be
a folder is one clear error."""
import os
import pathlib
import time

import pytest

from qwen38_model import Qwen38Error, synthetic


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN38_CACHE", str(tmp_path))
    return tmp_path


def test_stale_builds_are_removed_fresh_ones_kept(cache):
    stale, fresh = cache / ".building-killed", cache / ".building-running"
    for folder in (stale, fresh):
        (folder / "hf").mkdir(parents=True)
    old = time.time() - synthetic.STALE_BUILD_SECONDS - 60
    os.utime(stale, (old, old))
    path = synthetic.default_model_path()
    assert path.is_file()
    assert sorted(p.name for p in cache.iterdir()) == [".building-running", path.parent.name]


def test_an_incomplete_model_folder_is_rebuilt(cache):
    final = cache / f"synthetic-default-v{synthetic.DEFAULT_MODEL_VERSION}"
    final.mkdir()  # empty: it used to be taken as the model, failing every later load
    path = synthetic.default_model_path()
    assert all((final / name).is_file() for name in synthetic.DEFAULT_MODEL_FILES)
    (final / "hf" / "model.safetensors").unlink()  # damaged later
    assert synthetic.default_model_path() == path and (final / "hf" / "model.safetensors").is_file()
    assert [p.name for p in cache.iterdir()] == [final.name]


def test_a_cache_path_that_is_a_file(tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    monkeypatch.setenv("QWEN38_CACHE", str(blocker))
    with pytest.raises(Qwen38Error, match=rf"cannot build the built-in model in {blocker} \(File exists: .*\); set "
                                          r"QWEN38_CACHE to a writable folder"):
        synthetic.default_model_path()


def test_the_suite_builds_nothing_in_the_users_cache():
    """conftest points QWEN38_CACHE at a temporary folder for the whole run (and the commands it starts)."""
    root = synthetic.default_model_dir().parent
    assert pathlib.Path.home() / ".cache" / "qwen38" not in (root, *root.parents), root
