"""Shared benchmark machinery: the streaming-read probe every ratio is measured against, CUDA-event timing
of a callable or of a captured CUDA graph, the run's environment, and table/JSON output.

Why a probe of our own: a cudaMemcpy (or a copy captured in a graph) both reads and writes and reports
low, which would flatter every ratio computed over it. The probe is a kernel of 16-byte loads that sums
a multi-GB buffer (far beyond the 60 MB L2), best of a few grid shapes, measured in the same process as
the kernels it is compared with.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
from typing import Callable, Iterable, Sequence

import torch

_REPO = pathlib.Path(__file__).resolve().parents[2]


def env_info() -> dict:
    """GPU, torch, CUDA, git commit and date of this run (goes into every benchmark JSON). The device
    machine gets a copy of the tree without .git, so the commit comes from QWEN38_COMMIT there."""
    # QWEN38_COMMIT first: a device run of an archived commit may sit inside some other checkout's tree.
    commit = os.environ.get("QWEN38_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True,
                                    text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    commit = commit or "unknown"
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count,
                    l2_bytes=getattr(props, "L2_cache_size", None), memory_bytes=props.total_memory)
    return info


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_eager(fn: Callable[[int], object], calls: int, replays: int = 5, warmup: int = 1) -> dict:
    """Seconds per call of fn(i) for i in range(calls), launched eagerly; median and min over replays."""
    for _ in range(warmup):
        for i in range(calls):
            fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = _events()
        start.record()
        for i in range(calls):
            fn(i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / calls)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn run once on a side stream (lazy init and allocations off the capture), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _profiled(replay: Callable[[], object], steps: int) -> torch.profiler.profile:
    """The CUDA profiler over `steps` calls of replay, after one call outside it (lazy init, warm caches)."""
    replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    return prof


def kernel_intervals(replay: Callable[[], object], steps: int = 1) -> list[tuple[str, float, float]]:
    """(kernel name, start us, end us) of every kernel over `steps` calls of replay, in start order, from the
    CUDA profiler's kernel records (copies and memsets are not kernels and not listed)."""
    prof = _profiled(replay, steps)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return sorted(kernels, key=lambda k: k[1])


def critical_path_us(intervals: Iterable[tuple[str, float, float]]) -> dict[str, float]:
    """Each kernel's share of the busy time, per name: from the later of its start and the end of every kernel
    that started before it, to its own end (nothing when it ends first). Under PDL a kernel starts while its
    predecessor drains and waits for it; this counts that overlap once, for the predecessor, so the shares add
    up to the time the GPU ran anything (the gaps between kernels are in no share)."""
    shares: dict[str, float] = {}
    done = float("-inf")
    for name, start, end in intervals:
        shares[name] = shares.get(name, 0.0) + max(0.0, end - max(start, done))
        done = max(done, end)
    return shares


def kernel_records(replay: Callable[[], object], steps: int = 1) -> list[tuple[str, int, float]]:
    """(kernel name, launches, GPU microseconds) per kernel over `steps` calls of replay, from the CUDA
    profiler's kernel records (copies and memsets are not kernels and not listed)."""
    prof = _profiled(replay, steps)
    return [(e.key, e.count, getattr(e, "device_time_total", 0.0)) for e in prof.key_averages()
            if getattr(e, "device_time_total", 0.0) > 0 and not e.key.startswith(("Memcpy", "Memset", "cudaGraph"))]


def time_graph(fn: Callable[[int], object], calls: int, replays: int = 10, warmup: int = 2) -> dict:
    """Seconds per call of fn(i) for i in range(calls), all captured in ONE torch.cuda.CUDAGraph and replayed.

    This is how decode runs (a captured graph of many launches), so per-launch CPU overhead is gone and
    what remains is the kernel plus the GPU-side gap between kernels. fn must only launch work on the
    current stream (no allocation, no host sync)."""
    def all_calls():
        for i in range(calls):
            fn(i)

    graph = capture_graph(all_calls)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = _events()
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / calls)
    del graph
    return {"median_s": statistics.median(times), "min_s": min(times)}


# ---- the streaming-read probe -------------------------------------------------------------------------

_probe_kernel = None


def _get_probe_kernel():
    global _probe_kernel
    if _probe_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def read_sum_kernel(src, dst, iters, BLOCK: tl.constexpr):
            # Program p reads tiles p, p + nprog, p + 2*nprog, ... (grid-strided, so at every moment the
            # whole grid streams one contiguous region). Offsets are multiples of BLOCK, which lets Triton
            # emit 16-byte vector loads (4 int32 per load).
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for i in range(iters):
                offs = (i * nprog + pid) * BLOCK + tl.arange(0, BLOCK)
                acc += tl.load(src + offs)
            tl.store(dst + pid, tl.sum(acc, axis=0))

        _probe_kernel = read_sum_kernel
    return _probe_kernel


def read_probe(size_bytes: int = 4 << 30, reps: int = 5) -> dict:
    """Streaming-read bandwidth of this GPU: best GB/s (1e9 bytes/s) over a few grid shapes of a kernel
    of 16-byte loads summing `size_bytes` (default 4 GiB). Returns {"best_gbps", "configs": [...]}."""
    kernel = _get_probe_kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = size_bytes // 4
    buf = torch.ones(n, dtype=torch.int32, device="cuda")
    configs = []
    for block, warps in ((2048, 4), (4096, 8), (8192, 8), (16384, 16)):
        for per_sm in (1, 2, 4, 8, 16):
            grid = sms * per_sm
            iters = n // (grid * block)
            if iters == 0:
                continue
            dst = torch.empty(grid, dtype=torch.int32, device="cuda")
            nbytes = iters * grid * block * 4

            def launch():
                kernel[(grid,)](buf, dst, iters, BLOCK=block, num_warps=warps)

            launch()  # compile + warm
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(reps):
                start, stop = _events()
                start.record()
                launch()
                stop.record()
                stop.synchronize()
                best = min(best, start.elapsed_time(stop) * 1e-3)
            configs.append({"block": block, "num_warps": warps, "grid": grid, "bytes": nbytes,
                            "gbps": nbytes / best / 1e9})
    del buf
    torch.cuda.empty_cache()
    return {"best_gbps": max(c["gbps"] for c in configs), "size_bytes": size_bytes, "configs": configs}


_probe_cache: dict | None = None


def read_probe_gbps() -> float:
    """Best streaming-read GB/s of this GPU, measured once per process (see read_probe)."""
    global _probe_cache
    if _probe_cache is None:
        _probe_cache = read_probe()
    return _probe_cache["best_gbps"]


def read_probe_result() -> dict:
    """The full probe record (all grid shapes) for the JSON; measures it if not done yet."""
    read_probe_gbps()
    return _probe_cache


def parse_args_and_probe(doc: str) -> tuple[argparse.Namespace, dict]:
    """The command line of a benchmark with only --json (described by the first line of `doc`, the
    module's docstring), then the streaming-read probe, measured and printed. Returns (args, probe record)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    probe = read_probe_result()
    print(f"streaming-read probe: {probe['best_gbps']:.0f} GB/s")
    return args, probe


# ---- output -------------------------------------------------------------------------------------------

def add_tiny_flag(parser: argparse.ArgumentParser, sizes: dict, model: str = "the built-in default model on the CPU"):
    """--tiny, a smoke test of a benchmark's code on a small model at `sizes` (its timings mean nothing)."""
    parser.add_argument("--tiny", action="store_true", help=f"smoke test: {model}, "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items()))


def parse_with_tiny(parser: argparse.ArgumentParser, argv, sizes: dict) -> argparse.Namespace:
    """parser's arguments; with --tiny, `sizes` are the defaults, and what the command line gives still wins."""
    args = parser.parse_args(argv)
    if args.tiny:
        parser.set_defaults(**sizes)
        args = parser.parse_args(argv)
    return args


def print_table(rows: Sequence[dict], columns: Iterable[str], title: str | None = None) -> None:
    columns = list(columns)

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    print(flush=True)


def default_result_path(env: dict, what: str) -> str:
    """benchmarks/results/<date>-<gpu>-<commit>-<what>.json, the name every committed result has."""
    gpu = str(env.get("gpu", "gpu")).replace(" ", "-")
    return f"benchmarks/results/{datetime.date.today().isoformat()}-{gpu}-{env.get('commit', 'unknown')}-{what}.json"


def write_json(path: str | os.PathLike | None, payload: dict) -> None:
    if not path:
        return
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
