"""Opening the files of a checkpoint that may come from anywhere: regular files only (a FIFO would block
open() forever), never outside the checkpoint folder (an index file must not make us read /etc/passwd),
JSON of bounded size."""
from __future__ import annotations

import json
import os
import pathlib
import stat

from .errors import CheckpointError

# Far above any real file of its kind (the 27B's config.json is 3 KB, its tokenizer.json 11 MB), far
# below what would hurt to read into memory.
JSON_LIMIT_BYTES = 256 << 20


def regular_file(path: pathlib.Path, what: str = "file") -> pathlib.Path:
    """path, checked to be an existing, readable regular file (symlinks followed)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such {what}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path}: not a regular file (the {what} must be one; found {_kind(info.st_mode)})")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"{path}: cannot read the {what} (Permission denied)")
    return path


def folder_file(folder: pathlib.Path, name: str, what: str = "file") -> pathlib.Path:
    """The file `name` of a checkpoint folder, refused if it lies outside the folder: an absolute name, a
    '..' part, or a symlink that leads out. One exception: a Hugging Face cache snapshot
    (.../snapshots/<revision>/) whose files are symlinks into the repository's blobs/ folder."""
    parts = pathlib.PurePosixPath(name).parts
    if not parts or name.startswith(("/", "\\")) or ".." in parts or ":" in name or "\0" in name:
        raise CheckpointError(f"{folder}: refusing {what} {name!r}: not a plain name inside the checkpoint folder")
    try:
        root = folder.resolve()
        target = (root / name).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise CheckpointError(f"{folder}: cannot resolve {what} {name!r} ({e})") from None
    inside = target.is_relative_to(root)
    hub_blob = root.parent.name == "snapshots" and target.parent == root.parent.parent / "blobs"
    if not (inside or hub_blob):
        raise CheckpointError(f"{folder}: refusing {what} {name!r}: it resolves to {target}, outside the "
                              "checkpoint folder")
    regular_file(target, what)
    return target


def read_json(path: pathlib.Path, what: str = "JSON file"):
    """The parsed JSON of a regular file of bounded size; every failure a CheckpointError naming the file."""
    regular_file(path, what)
    size = path.stat().st_size
    if size > JSON_LIMIT_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, more than the {JSON_LIMIT_BYTES} a {what} may have")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 (byte {e.start}: {e.reason})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, absurd nesting
        raise CheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def optional_json_object(folder: pathlib.Path, name: str) -> dict:
    """The JSON object in the folder's file `name`, or {} when the folder has no such file."""
    if not (folder / name).exists():
        return {}
    path = folder_file(folder, name)
    value = read_json(path, name)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "something else"
