"""`python -m benchmarks.serve --tiny`: the serving benchmark end to end on the built-in model (CPU): the server
in-process, streamed openai clients, the join, the solo-run check. A smoke test of the script; its figures mean
nothing on the CPU."""
import json
import pathlib
import subprocess
import sys

import pytest

from conftest import require

# The test extra has them: under CI=true a missing one fails rather than skips.
for module in ("openai", "starlette", "uvicorn"):
    require(module)

from benchmarks.serve import TINY, benchmark_tokenizer, percentile  # noqa: E402


def test_serve_benchmark_runs_tiny(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "-m", "benchmarks.serve", "--tiny", "--json", str(out)], check=True,
                   cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, timeout=120)
    results = json.loads(out.read_text())
    clients = [int(c) for c in TINY["clients"].split(",")]
    assert results["tiny"] and results["settings"]["clients"] == clients
    assert [r["clients"] for r in results["runs"]] == clients
    for run in results["runs"]:
        n = run["clients"]
        # Every request ran to max_tokens (end tokens ignored), none restored from the prefix cache.
        assert run["exact_new_tokens"] == n and run["tokens"] == n * TINY["new_tokens"]
        assert run["cached_tokens"] == 0
        assert run["ttft_s"]["count"] == n and 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p99"]
        assert run["itl_s"]["count"] > 0 and run["aggregate_tok_s"] > 0 and run["wall_s"] > 0
    check = results["correctness"]
    assert check["clients"] == max(clients) and check["checked"] == TINY["check_solo"]
    assert check["matched"] == check["checked"]  # greedy, batch-invariant: every client's text is its solo run's
    join = results["join"]
    assert join["decoders"] == TINY["join_decoders"] and join["joiner_tokens"] == TINY["join_new"]
    assert join["joiner_ttft_s"] > 0 and join["joiner_alone_ttft_s"] > 0
    for window in ("before", "during", "after"):
        assert f"itl_{window}_s" in join
    assert join["decoders_run"]["exact_new_tokens"] == TINY["join_decoders"]


def test_benchmark_tokenizer_decodes_every_id():
    tokenizer = benchmark_tokenizer(1000)
    assert len(tokenizer) == 1000
    assert tokenizer.decode([0, 7, 999]) == "<0><7><999>"
    decoder = tokenizer.stream_decoder(skip_special_tokens=True)
    assert [decoder.feed(i) for i in (3, 998)] == ["<3>", "<998>"]


def test_percentile_is_linear_between_ranks():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile([5.0], 99) == 5.0
