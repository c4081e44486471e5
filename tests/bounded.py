"""A test function run in a fresh interpreter under an address-space and a CPU-time limit: for fuzz cases that
could hang or grow without bound, so that such a case fails its test instead of the machine."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHILD_BYTES = 6 << 30  # address space: torch's import maps ~2 GB; a case that tried to grow hits this
CHILD_CPU_SECONDS = 120  # the fuzz files' cases take seconds


def run_bounded(function: str, test_file: str) -> subprocess.CompletedProcess:
    """`function` of the test module `test_file` in a fresh interpreter (the checkout, tests/ and the module's
    folder first on sys.path, whatever is installed) under CHILD_BYTES of address space and
    CHILD_CPU_SECONDS of CPU."""
    def limits():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_BYTES, CHILD_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_SECONDS, CHILD_CPU_SECONDS))

    folders = [str(ROOT), str(ROOT / "tests"), os.path.dirname(os.path.abspath(test_file))]
    code = (f"import sys; sys.path[:0] = {folders!r}\n"
            "import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('bounded', {test_file!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            f"module.{function}()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          preexec_fn=limits, timeout=2 * CHILD_CPU_SECONDS)


def assert_cases_passed(function: str, test_file: str, cases: int) -> None:
    """run_bounded(function, test_file) exited 0 and printed that all `cases` cases passed."""
    result = run_bounded(function, test_file)
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert f"{cases} cases passed" in result.stdout
