"""Exit 0 when `make demo` / `make test` need not reinstall: qwen38 is installed from this checkout, its
extension was built against the torch installed now and after the last change to what the build reads
(setup.py, pyproject.toml, csrc/), and the test extra's packages are installed. Else print why, exit 1.
(A reinstall costs ~20 s on the CPU machine, minutes with the CUDA kernels; `make install` always does it.)"""
import importlib.metadata
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def why_reinstall() -> str | None:
    try:
        import qwen38_ops  # refuses an extension built against another torch
    except Exception as e:  # noqa: BLE001 (whatever fails, the answer is: install)
        return f"qwen38_ops does not import ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if pathlib.Path(qwen38_ops.__file__).resolve().parent != REPO / "qwen38_ops":
        return f"qwen38_ops is installed from {pathlib.Path(qwen38_ops.__file__).parent}, not this checkout"
    built = min(p.stat().st_mtime for p in (REPO / "qwen38_ops").glob("_C*.so"))
    read_by_build = [REPO / "setup.py", REPO / "pyproject.toml", *sorted((REPO / "csrc").rglob("*"))]
    changed = [p for p in read_by_build if p.is_file() and p.stat().st_mtime > built]
    if changed:
        return f"{changed[0].relative_to(REPO)} changed after the last build"
    for requirement in importlib.metadata.requires("qwen38") or []:
        if "extra" in requirement and 'extra == "test"' not in requirement:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return f"{name} is not installed"
    return None


if __name__ == "__main__":
    reason = why_reinstall()
    print(f"installing: {reason}" if reason else
          "qwen38 is installed from this checkout and its build is current: not reinstalling (`make install` forces it)")
    sys.exit(1 if reason else 0)
