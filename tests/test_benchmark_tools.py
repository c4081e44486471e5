"""The profiler arithmetic of benchmarks/ (CPU): the critical-path shares of overlapping kernels, and the decode
benchmark's per-part split built on them, on made-up kernel intervals; the batch benchmark's MTP projection and
the options it needs."""
import pytest

import benchmarks.batch as batch
import benchmarks.decode as decode
from benchmarks.ops.common import critical_path_us

# (name, start us, end us) in start order, as the profiler gives them under PDL: b launches while a drains and
# waits for it; c starts after a gap; d overlaps c entirely (ends first).
INTERVALS = [("a", 0.0, 10.0), ("b", 6.0, 15.0), ("c", 20.0, 30.0), ("d", 22.0, 25.0)]


def test_critical_path_counts_overlap_once_for_the_predecessor():
    shares = critical_path_us(INTERVALS)
    assert shares == {"a": 10.0, "b": 5.0, "c": 10.0, "d": 0.0}
    assert sum(shares.values()) == 25.0  # the union of the intervals; the 5 us gap is in no share


def test_kernel_split_adds_up(monkeypatch):
    names = ["q8_0_gemv_kernel<1>", "produce_kernel<(Producer)2>", "gdn_step_kernel<4, 1, 2>", "other_kernel"]
    per_step = [(names[0], 0.0, 10.0), (names[1], 6.0, 15.0), (names[2], 14.0, 18.0), (names[3], 20.0, 21.0)]
    steps = 2
    intervals = [(n, s + 100 * k, e + 100 * k) for k in range(steps) for n, s, e in per_step]
    monkeypatch.setattr(decode, "kernel_intervals", lambda replay, steps: intervals)
    split = decode.kernel_split(None, steps=steps)
    assert split["launches_per_token"] == 4
    assert split["gemv"] == pytest.approx(0.010) and split["produce"] == pytest.approx(0.009)
    assert split["critical_ms"]["gemv"] == pytest.approx(0.010)
    assert split["critical_ms"]["produce"] == pytest.approx(0.005)
    assert split["critical_ms"]["gdn_small_ops"] == pytest.approx(0.003)
    assert split["busy_ms"] == pytest.approx(0.019)
    assert split["span_ms"] == pytest.approx(0.0605)  # 0 .. 121 us over 2 steps: the gaps are not busy
    assert split["kernels"]["produce_kernel<(Producer)2>"]["launches"] == 1


def test_mtp_projection_is_capped_at_k_plus_one_tokens_a_step():
    assert batch.projected_tok_s(8, 4, 3.28, 0.040) == pytest.approx(8 * 3.28 / 0.040)
    assert batch.projected_tok_s(8, 2, 3.28, 0.040) == pytest.approx(8 * 3 / 0.040)  # 2 drafts: at most 3 tokens
    assert batch.projected_tok_s(1, 1, 2.52, 0.010) == pytest.approx(2 / 0.010)


@pytest.mark.parametrize("args", [["--batches", "1,2", "--mtp-batches", "1,8"], ["--contexts", "4096"]])
def test_mtp_batches_need_the_plain_step_they_are_compared_with(args, capsys):
    with pytest.raises(SystemExit) as exit:  # before any GPU work
        batch.main(args)
    assert exit.value.code == 2 and "--mtp-batches" in capsys.readouterr().err
