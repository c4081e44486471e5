"""gdn_step: a GDN layer's decode step (conv, gates, recurrence, gated RMSNorm + quantized lane) in one op.

CPU (CI): opcheck; the reference against the op sequence it fuses (gdn_conv -> gdn_gates -> gdn_recurrent ->
gated_rms_norm on the slices of [q | k | v | z | b | a]), bit for bit; T tokens against T one-token calls.
CUDA (-m cuda): the kernel bit for bit against the CUDA op sequence (its recurrence token by token: with
token_states, which any T runs so) at the 27B shape for T = 1..8 and at odd shapes (every recurrent lane
layout, Hv/Hk from 1 to 8, dv not a multiple of 32), with and without per-token states, in all three
activation lanes, every output poisoned first (NaN; int8 lanes with different values in the two runs) and
the states inside NaN padding; T tokens == T decode steps; row-strided and misaligned x; one launch; back to
back on one state and graph replay == eager, with PDL on and off; opcheck; bad arguments raise.

Batched rows (conv_state [T, K-1, C], state [T, Hv, dv, dk]: row t a sequence of its own, one token): on the CPU
the reference against one-row calls, opcheck, per-token states refused; on CUDA the kernel bit for bit against the
op sequence run row by row on each row's own states (and near the float64 reference), at the 27B shape and odd
shapes, in all three lanes, outputs poisoned and the states inside NaN padding, T past MAX_TOKENS; every row bit
for bit a T = 1 call on its own states for T up to 64; graph replay == eager; bad arguments raise.

Batched verify rows (conv_state [B, K-1, C], state [B, Hv, dv, dk] for B * n rows: n consecutive tokens a
sequence, the state after each kept): on the CPU the reference against each sequence's n-token call, opcheck; on
CUDA the kernel bit for bit against the op sequence run on each sequence alone, at the 27B shape and odd shapes, in
all three lanes, with and without token states, outputs poisoned and the states and token states inside NaN
padding; every sequence bit for bit its own n-token call (the one-sequence verify) for B up to 16; graph replay ==
eager; bad arguments raise.
"""
import copy

import pytest
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.gdn_step import MAX_TOKENS
from qwen38_ops.reference import gdn_step as ref

from cuda_helpers import (TORCH_ERROR_CONTROL, assert_cuda_kernel, capture_graph, child_env, cuda, progress,
                          run_in_child)

ops = torch.ops.qwen38
NAN = float("nan")
EPS = 1e-6
LANES = ("f32", "int8", "int8x2")

# (Hk, Hv, dk, dv): the 27B model, the oracle, and odd shapes covering every recurrent lane layout the kernel
# takes (dk % 4 == 0: 16-byte lanes, 1 chunk (dk <= 128) or 2; else scalar lanes, 1, 2, 4 or 8 chunks), Hv/Hk
# from 1 to 8, dv not a multiple of 32 (f32 lane only) and several passes of state rows (dv = 256).
SHAPE_27B = (16, 48, 128, 128)
SHAPE_ORACLE = (2, 6, 32, 32)
SHAPES_ODD = [(2, 4, 256, 64), (2, 2, 200, 24), (1, 3, 30, 32), (1, 8, 62, 64), (2, 4, 102, 36), (1, 2, 250, 256),
              (4, 4, 64, 40)]


class Inputs:
    """A decode step's inputs at one shape, x row-strided with NaN past each row's end (a read beyond x's
    width shows as NaN)."""

    def __init__(self, T, shape, taps=4, device="cuda", seed=0, dtype=torch.float32, batched=False, sequences=None):
        """batched: conv_state [T, taps-1, C] and state [T, Hv, dv, dk], a sequence's states a row; sequences=B:
        [B, ...], x's T rows B sequences of T / B tokens."""
        hk, hv, dk, dv = shape
        self.hk, self.hv, self.dk, self.dv, self.taps = hk, hv, dk, dv, taps
        self.C, self.Z = 2 * hk * dk + hv * dv, hv * dv
        width = self.C + self.Z + 2 * hv
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(T, width, generator=g, dtype=torch.float64)
        x[:, self.C + self.Z :] *= 4  # gates across their range
        if T > 0:
            x[0, self.C + self.Z + hv] = 30.0  # a + dt_bias > 20: softplus's linear branch
        stride = (width + 3) // 4 * 4 + 4  # rows 16-byte aligned: gated_rms_norm reads z as float4
        wide = torch.full((T, stride), NAN, dtype=torch.float64)
        wide[:, :width] = x
        self.x = wide.to(device=device, dtype=dtype)[:, :width]
        self.conv_weight = (torch.randn(self.C, taps, generator=g, dtype=torch.float64) * 0.5).to(device, dtype)
        lead = (sequences,) if sequences else (T,) if batched else ()
        self.conv_state = torch.randn(*lead, taps - 1, self.C, generator=g, dtype=torch.float64).to(device, dtype)
        self.a_neg = -torch.exp(torch.randn(hv, generator=g, dtype=torch.float64) - 2).to(device, dtype)
        self.dt_bias = torch.randn(hv, generator=g, dtype=torch.float64).to(device, dtype)
        self.norm_weight = (1 + 0.2 * torch.randn(dv, generator=g, dtype=torch.float64)).to(device, dtype)
        self.state = (torch.randn(*lead, hv, dv, dk, generator=g, dtype=torch.float64) * 0.5).to(device, dtype)
        self.device, self.dtype = device, dtype

    def outputs(self, T, lane, token_states, poison):
        """Output buffers: floats NaN, int8 lanes `poison` (different per run, so an unwritten value differs)."""
        full = lambda *size, dtype=self.dtype, fill=NAN: torch.full(size, fill, dtype=dtype, device=self.device)
        o = dict(out=full(T, self.Z), out_q=None, out_q_lo=None, out_d=None, token_conv_states=None, token_states=None)
        if lane != "f32":
            o.update(out_q=full(T, self.Z, dtype=torch.int8, fill=poison), out_d=full(T, self.Z // 32))
        if lane == "int8x2":
            o.update(out_q_lo=full(T, self.Z, dtype=torch.int8, fill=poison))
        if token_states:
            o.update(token_conv_states=full(T, self.taps - 1, self.C), token_states=full(T, self.hv, self.dv, self.dk))
        return o

    def row(self, t):
        """Row t of batched inputs as one sequence's one-token inputs: x's row t, conv_state[t], state[t] (views)."""
        return self.sequence(t, 1)

    def sequence(self, b, n):
        """Sequence b of batched inputs of n tokens each, as one sequence's inputs (views)."""
        one = copy.copy(self)
        one.x, one.conv_state, one.state = self.x[b * n : (b + 1) * n], self.conv_state[b], self.state[b]
        return one


def run_step(inp, x, lane, token_states, conv_state=None, state=None, poison=-77):
    """gdn_step on copies of the states (or the given ones, in place); returns every output by name."""
    o = inp.outputs(x.shape[0], lane, token_states, poison=poison)
    o.update(conv_state=inp.conv_state.clone() if conv_state is None else conv_state,
             state=inp.state.clone() if state is None else state)
    ops.gdn_step(x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, o["conv_state"], o["state"],
                 o["out"], o["out_q"], o["out_q_lo"], o["out_d"], o["token_conv_states"], o["token_states"])
    return o


def run_sequence(inp, lane):
    """The four ops gdn_step fuses, on the slices of x, from copies of the states. gdn_recurrent gets
    token_states, so it runs token by token at any T (without them it runs its chunked kernel from T = 8);
    its out and state are the same bits either way below 8 tokens (test_gdn.py)."""
    T, C, Z = inp.x.shape[0], inp.C, inp.Z
    o = inp.outputs(T, lane, token_states=True, poison=77)
    o.update(conv_state=inp.conv_state.clone(), state=inp.state.clone())
    conv = torch.full((T, C), NAN, dtype=inp.dtype, device=inp.device)
    ops.gdn_conv(inp.x[:, :C], o["conv_state"], inp.conv_weight, inp.hk, inp.dk, conv, o["token_conv_states"])
    beta = torch.full((T, inp.hv), NAN, dtype=inp.dtype, device=inp.device)
    decay = torch.full_like(beta, NAN)
    ops.gdn_gates(inp.x[:, C + Z :], inp.a_neg, inp.dt_bias, beta, decay)
    core = torch.full((T, inp.hv, inp.dv), NAN, dtype=inp.dtype, device=inp.device)
    ops.gdn_recurrent(conv, beta, decay, o["state"], core, o["token_states"])
    ops.gated_rms_norm(core.view(T, -1), inp.x[:, C : C + Z], inp.norm_weight, EPS, o["out"], o["out_q"],
                       o["out_q_lo"], o["out_d"])
    return o


def assert_same_bits(got, want, names=None):
    for name in names or [k for k, v in got.items() if v is not None]:
        assert got[name] is not None and want[name] is not None, name
        assert torch.equal(got[name], want[name]), (name, (got[name] != want[name]).sum().item())


# ---------------------------------------------------------------------------------------------------
# CPU

def test_opcheck_cpu():
    inp = Inputs(3, SHAPE_ORACLE, device="cpu")
    for lane, token_states in (("f32", False), ("int8", True), ("int8x2", False)):
        o = inp.outputs(3, lane, token_states, poison=0)
        args = (inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, inp.conv_state.clone(),
                inp.state.clone(), o["out"], o["out_q"], o["out_q_lo"], o["out_d"], o["token_conv_states"],
                o["token_states"])
        torch.library.opcheck(ops.gdn_step.default, args)


@pytest.mark.parametrize("shape", [SHAPE_ORACLE, (1, 3, 30, 32), (2, 4, 24, 40)])
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_equals_op_sequence(shape, T, lane, dtype):
    """The reference (the op's CPU kernel) is the sequence of the four ops on x's slices: q|k|v to the conv,
    b|a (after z) to the gates, z to the norm. Bit for bit, every output and both states."""
    if lane != "f32" and shape[3] % 32:
        pytest.skip("the quantized lanes need dv % 32 == 0")
    inp = Inputs(T, shape, device="cpu", seed=T, dtype=dtype)
    assert_same_bits(run_step(inp, inp.x, lane, token_states=True), run_sequence(inp, lane))
    got = run_step(inp, inp.x, lane, token_states=False)
    assert_same_bits(got, run_sequence(inp, lane))
    assert torch.isfinite(got["out"]).all() and torch.isfinite(got["state"]).all()


def test_reference_tokens_are_decode_steps():
    """T tokens in one call against T one-token calls: the conv states (copies of inputs) bit for bit; the
    outputs and recurrent states to float32 rounding (CPU reductions over [T, ...] and [1, ...] tensors may
    group differently; the CUDA test asserts bits)."""
    T = 5
    inp = Inputs(T, SHAPE_ORACLE, device="cpu", seed=3)
    whole = run_step(inp, inp.x, "f32", token_states=True)
    conv_state, state = inp.conv_state.clone(), inp.state.clone()
    for t in range(T):
        one = run_step(inp, inp.x[t : t + 1], "f32", token_states=False, conv_state=conv_state, state=state)
        assert torch.equal(whole["token_conv_states"][t], conv_state)
        torch.testing.assert_close(whole["token_states"][t], state, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(one["out"][0], whole["out"][t], rtol=1e-6, atol=1e-6)
    assert torch.equal(whole["conv_state"], conv_state)
    torch.testing.assert_close(whole["state"], state, rtol=1e-6, atol=1e-6)


def opcheck_batched_rows(device):
    inp = Inputs(3, SHAPE_ORACLE, device=device, batched=True)
    for lane in LANES:
        o = inp.outputs(3, lane, token_states=False, poison=0)
        args = (inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, inp.conv_state.clone(),
                inp.state.clone(), o["out"], o["out_q"], o["out_q_lo"], o["out_d"], None, None)
        torch.library.opcheck(ops.gdn_step.default, args)


def test_opcheck_cpu_batched_rows():
    opcheck_batched_rows("cpu")


@pytest.mark.parametrize("shape", [SHAPE_ORACLE, (1, 3, 30, 32)])
@pytest.mark.parametrize("T", [1, 3, MAX_TOKENS + 1])
@pytest.mark.parametrize("lane", LANES)
def test_reference_batched_rows_are_one_row_calls(shape, T, lane):
    """Batched rows (conv_state [T, K-1, C], state [T, Hv, dv, dk]): row t is one token of a sequence of its own,
    on conv_state[t] and state[t]: its outputs and both new states bit for bit a one-row call's on copies of that
    row's states, also past MAX_TOKENS rows."""
    if lane != "f32" and shape[3] % 32:
        pytest.skip("the quantized lanes need dv % 32 == 0")
    inp = Inputs(T, shape, device="cpu", seed=T, batched=True)
    together = run_step(inp, inp.x, lane, token_states=False)
    for t in range(T):
        alone = run_step(inp.row(t), inp.x[t : t + 1], lane, token_states=False)
        for name in ("out", "out_q", "out_q_lo", "out_d"):
            if alone[name] is not None:
                assert torch.equal(together[name][t : t + 1], alone[name]), (t, name)
        assert torch.equal(together["conv_state"][t], alone["conv_state"]), t
        assert torch.equal(together["state"][t], alone["state"]), t
    assert torch.isfinite(together["out"]).all() and not torch.equal(together["state"], inp.state)


def test_opcheck_cpu_batched_verify_rows():
    inp = Inputs(6, SHAPE_ORACLE, device="cpu", sequences=2)
    for lane, token_states in (("f32", True), ("int8x2", False)):
        o = inp.outputs(6, lane, token_states, poison=0)
        args = (inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, inp.conv_state.clone(),
                inp.state.clone(), o["out"], o["out_q"], o["out_q_lo"], o["out_d"], o["token_conv_states"],
                o["token_states"])
        torch.library.opcheck(ops.gdn_step.default, args)


@pytest.mark.parametrize("sequences, n", [(1, 3), (2, 4), (3, MAX_TOKENS)])
@pytest.mark.parametrize("lane", LANES)
def test_reference_batched_verify_rows_are_sequence_calls(sequences, n, lane):
    """B sequences of n tokens (state [B, Hv, dv, dk]): sequence b's outputs, per-token states (at its rows of the
    token states) and new states bit for bit its own n-token call on copies of its states."""
    inp = Inputs(sequences * n, SHAPE_ORACLE, device="cpu", seed=n, sequences=sequences)
    together = run_step(inp, inp.x, lane, token_states=True)
    for b in range(sequences):
        rows = slice(b * n, (b + 1) * n)
        alone = run_step(inp.sequence(b, n), inp.x[rows], lane, token_states=True)
        for name in ("out", "out_q", "out_q_lo", "out_d", "token_conv_states", "token_states"):
            if alone[name] is not None:
                assert torch.equal(together[name][rows], alone[name]), (b, name)
        assert torch.equal(together["conv_state"][b], alone["conv_state"]), b
        assert torch.equal(together["state"][b], alone["state"]), b


def test_reference_batched_rows_the_sequences_do_not_divide_are_refused():
    inp = Inputs(5, SHAPE_ORACLE, device="cpu", sequences=2)
    with pytest.raises(RuntimeError, match="B = 2 must divide the 5 rows"):
        run_step(inp, inp.x, "f32", token_states=False)


# ---------------------------------------------------------------------------------------------------
# CUDA: bit for bit against the op sequence.

def check_against_sequence(shape, T, lane, token_states, seed=0):
    inp = Inputs(T, shape, seed=seed)
    want = run_sequence(inp, lane)
    got = run_step(inp, inp.x, lane, token_states)
    assert_same_bits(got, want)
    assert torch.isfinite(got["out"]).all() and torch.isfinite(got["state"]).all()


@cuda
@pytest.mark.parametrize("T", range(1, MAX_TOKENS + 1))
@pytest.mark.parametrize("token_states", [False, True])
@pytest.mark.parametrize("lane", LANES)
def test_27b_equals_op_sequence(T, token_states, lane):
    assert_cuda_kernel("gdn_step")
    check_against_sequence(SHAPE_27B, T, lane, token_states, seed=T)


@cuda
@pytest.mark.parametrize("shape", [SHAPE_ORACLE] + SHAPES_ODD)
@pytest.mark.parametrize("T", [1, 2, 5, 8])
@pytest.mark.parametrize("token_states", [False, True])
@pytest.mark.parametrize("lane", LANES)
def test_odd_shapes_equal_op_sequence(shape, T, token_states, lane):
    if lane != "f32" and shape[3] % 32:
        pytest.skip("the quantized lanes need dv % 32 == 0")
    check_against_sequence(shape, T, lane, token_states, seed=sum(shape) + T)


@cuda
@pytest.mark.parametrize("taps", [2, 3, 8])
def test_conv_widths(taps):
    """Conv kernels of 2, 3 and 8 taps (the model's is 4): more taps than tokens, and fewer."""
    for T in (1, 3, 8):
        inp = Inputs(T, SHAPE_ORACLE, taps=taps, seed=taps + T)
        assert_same_bits(run_step(inp, inp.x, "int8", True), run_sequence(inp, "int8"))


def padded(t, pad=64):
    """t's values inside a NaN-filled buffer, pad elements either side (alignment kept): (view, buffer)."""
    buf = torch.full((t.numel() + 2 * pad,), NAN, dtype=t.dtype, device=t.device)
    view = buf[pad : pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


@cuda
@pytest.mark.parametrize("T", [1, 8])
def test_27b_writes_nothing_outside(T):
    """States, outputs and per-token states inside NaN padding: the padding is untouched, the values are the
    op sequence's."""
    inp = Inputs(T, SHAPE_27B, seed=20 + T)
    want = run_sequence(inp, "int8x2")
    o = inp.outputs(T, "int8x2", True, poison=-77)
    views, bufs = {}, []
    for name, t in dict(conv_state=inp.conv_state, state=inp.state, out=o["out"], out_d=o["out_d"],
                        token_conv_states=o["token_conv_states"], token_states=o["token_states"]).items():
        views[name], buf = padded(t)
        bufs.append(buf)
    ops.gdn_step(inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, views["conv_state"],
                 views["state"], views["out"], o["out_q"], o["out_q_lo"], views["out_d"], views["token_conv_states"],
                 views["token_states"])
    for buf in bufs:
        assert buf[:64].isnan().all() and buf[-64:].isnan().all(), "a write outside an output"
    assert_same_bits(dict(views, out_q=o["out_q"], out_q_lo=o["out_q_lo"]), want)


@cuda
@pytest.mark.parametrize("shape", [SHAPE_27B, (1, 3, 30, 32)])
def test_tokens_equal_decode_steps(shape):
    """T tokens in one call == T calls of one token on the same states, bit for bit: every output row, every
    per-token state, the final states (what speculative decoding's verify relies on)."""
    T = MAX_TOKENS
    inp = Inputs(T, shape, seed=4)
    whole = run_step(inp, inp.x, "int8", token_states=True)
    conv_state, state = inp.conv_state.clone(), inp.state.clone()
    for t in range(T):
        one = run_step(inp, inp.x[t : t + 1], "int8", token_states=False, conv_state=conv_state, state=state)
        for name in ("out", "out_q", "out_d"):
            assert torch.equal(one[name][0], whole[name][t]), (t, name)
        assert torch.equal(whole["token_conv_states"][t], conv_state) and torch.equal(whole["token_states"][t], state)
    assert torch.equal(whole["conv_state"], conv_state) and torch.equal(whole["state"], state)


@cuda
def test_misaligned_and_contiguous_x():
    """x's rows read as scalars: a contiguous x, a row-strided one and one whose rows start 4 bytes past a
    16-byte boundary give the same bits."""
    T = 5
    inp = Inputs(T, SHAPE_27B, seed=5)
    want = run_step(inp, inp.x, "int8x2", True)
    wide = torch.full((T, inp.x.shape[1] + 9), NAN, device="cuda")
    wide[:, 1 : 1 + inp.x.shape[1]] = inp.x
    for x in (inp.x.contiguous(), wide[:, 1 : 1 + inp.x.shape[1]]):
        assert_same_bits(run_step(inp, x, "int8x2", True), want)


def kernels_run_by(fn) -> list[str]:
    """The names of the CUDA kernels fn() launches (profiler), one entry per launch."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@cuda
def test_one_launch():
    inp = Inputs(3, SHAPE_27B)
    names = kernels_run_by(lambda: run_step(inp, inp.x, "int8", True))
    assert sum("gdn_step_kernel" in n for n in names) == 1 and not any("gdn_" in n and "gdn_step" not in n
                                                                        for n in names), names


@cuda
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_back_to_back_and_graph_replay(pdl):
    """check_back_to_back_and_graph_replay with programmatic dependent launch on and off (children)."""
    run_in_child(__file__, "check_back_to_back_and_graph_replay", preamble=child_env(QWEN38_PDL=pdl))


def check_back_to_back_and_graph_replay():
    """Eight one-token calls back to back on the SAME states, nothing in between (each must see the conv and
    recurrent state the previous one wrote: the PDL wait, and the cluster barrier that orders a key head's
    conv-state reads before its rewrite), eagerly and replayed from a captured graph: equal to one call of 8
    tokens, and the replay bit for bit the eager run; a verify-shaped call (8 tokens with per-token states)
    replays bit for bit too."""
    T = MAX_TOKENS
    inp = Inputs(T, SHAPE_27B, seed=6)
    whole = run_step(inp, inp.x, "int8", token_states=True)
    conv_state, state = inp.conv_state.clone(), inp.state.clone()
    rows = [inp.x[t : t + 1] for t in range(T)]
    outs = [inp.outputs(1, "int8", False, poison=-77) for _ in range(T)]

    def steps():
        for x, o in zip(rows, outs):
            ops.gdn_step(x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, conv_state, state,
                         o["out"], o["out_q"], o["out_q_lo"], o["out_d"])

    def reset():
        conv_state.copy_(inp.conv_state)
        state.copy_(inp.state)
        for o in outs:
            o["out"].fill_(NAN)
            o["out_d"].fill_(NAN)
            o["out_q"].fill_(-77)

    def results():
        return [conv_state.clone(), state.clone()] + [o[k].clone() for o in outs for k in ("out", "out_q", "out_d")]

    reset()
    steps()
    eager = results()
    assert torch.equal(conv_state, whole["conv_state"]) and torch.equal(state, whole["state"])
    for t, o in enumerate(outs):
        assert torch.equal(o["out"][0], whole["out"][t]) and torch.equal(o["out_q"][0], whole["out_q"][t]), t
    reset()
    graph = capture_graph(steps)
    reset()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(results(), eager):
        assert torch.equal(got, want)

    verify = inp.outputs(T, "int8x2", True, poison=-77)
    verify.update(conv_state=inp.conv_state.clone(), state=inp.state.clone())

    def step():
        ops.gdn_step(inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, verify["conv_state"],
                     verify["state"], verify["out"], verify["out_q"], verify["out_q_lo"], verify["out_d"],
                     verify["token_conv_states"], verify["token_states"])

    graph = capture_graph(step)
    for name, t in verify.items():
        if name == "conv_state":
            t.copy_(inp.conv_state)
        elif name == "state":
            t.copy_(inp.state)
        else:
            t.fill_(-77 if t.dtype == torch.int8 else NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(verify, run_step(inp, inp.x, "int8x2", True))


def check_batched_against_sequence(shape, T, lane, seed):
    """Batched rows with the states, out and out_d inside NaN padding and every output poisoned: the padding is
    untouched, and row t is bit for bit the CUDA op sequence run on row t alone, on copies of its own states."""
    inp = Inputs(T, shape, seed=seed, batched=True)
    want = [run_sequence(inp.row(t), lane) for t in range(T)]
    o = inp.outputs(T, lane, token_states=False, poison=-77)
    views, bufs = dict(out_q=o["out_q"], out_q_lo=o["out_q_lo"], out_d=None), []
    for name, t in dict(conv_state=inp.conv_state, state=inp.state, out=o["out"], out_d=o["out_d"]).items():
        if t is not None:
            views[name], buf = padded(t)
            bufs.append(buf)
    ops.gdn_step(inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, views["conv_state"],
                 views["state"], views["out"], views["out_q"], views["out_q_lo"], views["out_d"])
    for buf in bufs:
        assert buf[:64].isnan().all() and buf[-64:].isnan().all(), "a write outside an output"
    for t in range(T):
        for name in ("out", "out_q", "out_q_lo", "out_d"):
            if want[t][name] is not None and name in views and views[name] is not None:
                assert torch.equal(views[name][t : t + 1], want[t][name]), (t, name)
        assert torch.equal(views["conv_state"][t], want[t]["conv_state"]), t
        assert torch.equal(views["state"][t], want[t]["state"]), t
    assert torch.isfinite(views["out"]).all() and torch.isfinite(views["state"]).all()


@cuda
@pytest.mark.parametrize("T", [1, 3, MAX_TOKENS + 5])
@pytest.mark.parametrize("lane", LANES)
def test_batched_27b_equals_op_sequence_per_row(T, lane):
    assert_cuda_kernel("gdn_step")
    check_batched_against_sequence(SHAPE_27B, T, lane, seed=40 + T)


@cuda
@pytest.mark.parametrize("shape", [SHAPE_ORACLE] + SHAPES_ODD)
@pytest.mark.parametrize("T", [2, 5])
@pytest.mark.parametrize("lane", LANES)
def test_batched_odd_shapes_equal_op_sequence_per_row(shape, T, lane):
    if lane != "f32" and shape[3] % 32:
        pytest.skip("the quantized lanes need dv % 32 == 0")
    check_batched_against_sequence(shape, T, lane, seed=sum(shape) + 50 + T)


@cuda
def test_batched_27b_near_float64_reference():
    """Batched rows against the float64 reference: the new conv states exactly (copies of inputs), the recurrent
    states within gdn_recurrent's bound (test_gdn.py), out within float32 rounding of the gated norm."""
    T = 5
    inp = Inputs(T, SHAPE_27B, seed=9, batched=True)
    got = run_step(inp, inp.x, "f32", token_states=False)
    f64 = lambda t: t.cpu().double()
    conv_state, state, out = f64(inp.conv_state), f64(inp.state), torch.empty(T, inp.Z, dtype=torch.float64)
    ref.gdn_step(f64(inp.x), f64(inp.conv_weight), f64(inp.a_neg), f64(inp.dt_bias), f64(inp.norm_weight), EPS,
                 conv_state, state, out)
    assert torch.equal(f64(got["conv_state"]), conv_state)
    torch.testing.assert_close(f64(got["state"]), state, rtol=0, atol=2e-5)
    torch.testing.assert_close(f64(got["out"]), out, rtol=1e-4, atol=1e-4)


@cuda
@pytest.mark.parametrize("T", [1, 2, 3, 8, 13, 64])
def test_batched_rows_equal_one_row_calls_bitwise(T):
    """The batch-invariance contract: row t of a batched call gives bit for bit what a T = 1 call (one sequence)
    on copies of row t's own states gives: out and its two-word int8 words and scales (the runs poisoned
    differently), both new states. The 27B shape, x row-strided."""
    inp = Inputs(T, SHAPE_27B, seed=30 + T, batched=True)
    together = run_step(inp, inp.x, "int8x2", token_states=False)
    for t in range(T):
        alone = run_step(inp.row(t), inp.x[t : t + 1], "int8x2", token_states=False, poison=77)
        for name in ("out", "out_q", "out_q_lo", "out_d"):
            assert torch.equal(together[name][t : t + 1], alone[name]), (t, name)
        assert torch.equal(together["conv_state"][t], alone["conv_state"]), t
        assert torch.equal(together["state"][t], alone["state"]), t


@cuda
def test_batched_graph_replay_equals_eager():
    """A batched step of 13 rows (past MAX_TOKENS) captured once and replayed from the same states: the eager bits."""
    T = 13
    inp = Inputs(T, SHAPE_27B, seed=7, batched=True)
    want = run_step(inp, inp.x, "int8", token_states=False)
    o = inp.outputs(T, "int8", token_states=False, poison=-77)
    o.update(conv_state=inp.conv_state.clone(), state=inp.state.clone())

    def step():
        ops.gdn_step(inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, o["conv_state"],
                     o["state"], o["out"], o["out_q"], None, o["out_d"])

    graph = capture_graph(step)
    o["conv_state"].copy_(inp.conv_state)
    o["state"].copy_(inp.state)
    for name in ("out", "out_d"):
        o[name].fill_(NAN)
    o["out_q"].fill_(77)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(o, want)


@cuda
def test_opcheck_cuda_batched_rows():
    opcheck_batched_rows("cuda")


def check_batched_verify_against_sequence(shape, sequences, n, lane, token_states, seed):
    """B sequences of n tokens with the states, out, out_d and token states inside NaN padding and every output
    poisoned: the padding is untouched, and sequence b's rows are bit for bit the CUDA op sequence run on that
    sequence alone, on copies of its own states (its token states at its rows)."""
    T = sequences * n
    inp = Inputs(T, shape, seed=seed, sequences=sequences)
    want = [run_sequence(inp.sequence(b, n), lane) for b in range(sequences)]
    o = inp.outputs(T, lane, token_states=token_states, poison=-77)
    views, bufs = dict(out_q=o["out_q"], out_q_lo=o["out_q_lo"]), []
    for name in ("conv_state", "state", "out", "out_d", "token_conv_states", "token_states"):
        t = getattr(inp, name) if name in ("conv_state", "state") else o[name]
        views[name] = None
        if t is not None:
            views[name], buf = padded(t)
            bufs.append(buf)
    ops.gdn_step(inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, views["conv_state"],
                 views["state"], views["out"], views["out_q"], views["out_q_lo"], views["out_d"],
                 views["token_conv_states"], views["token_states"])
    for buf in bufs:
        assert buf[:64].isnan().all() and buf[-64:].isnan().all(), "a write outside an output"
    for b in range(sequences):
        rows = slice(b * n, (b + 1) * n)
        for name in ("out", "out_q", "out_q_lo", "out_d", "token_conv_states", "token_states"):
            if views[name] is not None:
                assert torch.equal(views[name][rows], want[b][name]), (b, name)
        assert torch.equal(views["conv_state"][b], want[b]["conv_state"]), b
        assert torch.equal(views["state"][b], want[b]["state"]), b
    assert torch.isfinite(views["out"]).all() and torch.isfinite(views["state"]).all()


@cuda
@pytest.mark.parametrize("sequences, n", [(1, 2), (3, 4), (16, 4), (5, MAX_TOKENS)])
@pytest.mark.parametrize("token_states", [False, True])
@pytest.mark.parametrize("lane", LANES)
def test_batched_verify_27b_equals_op_sequence_per_sequence(sequences, n, token_states, lane):
    assert_cuda_kernel("gdn_step")
    check_batched_verify_against_sequence(SHAPE_27B, sequences, n, lane, token_states, seed=60 + sequences * n)


@cuda
@pytest.mark.parametrize("shape", [SHAPE_ORACLE] + SHAPES_ODD)
@pytest.mark.parametrize("sequences, n", [(2, 3), (3, 7)])
@pytest.mark.parametrize("lane", LANES)
def test_batched_verify_odd_shapes_equal_op_sequence_per_sequence(shape, sequences, n, lane):
    if lane != "f32" and shape[3] % 32:
        pytest.skip("the quantized lanes need dv % 32 == 0")
    check_batched_verify_against_sequence(shape, sequences, n, lane, True, seed=sum(shape) + 70 + n)


@cuda
@pytest.mark.parametrize("sequences, n", [(2, 2), (8, 4), (16, 4), (9, 7)])
def test_batched_verify_equals_one_sequence_calls_bitwise(sequences, n):
    """The contract the batched speculative step rests on: sequence b's n rows of a batched call give bit for bit
    what its one-sequence verify (n tokens on copies of its own states, which gives n decode steps' bits:
    test_tokens_equal_decode_steps) gives: out, its two-word int8 words and scales (the runs poisoned differently),
    every per-token state, both new states. The 27B shape, x row-strided."""
    T = sequences * n
    inp = Inputs(T, SHAPE_27B, seed=80 + T, sequences=sequences)
    together = run_step(inp, inp.x, "int8x2", token_states=True)
    for b in range(sequences):
        rows = slice(b * n, (b + 1) * n)
        alone = run_step(inp.sequence(b, n), inp.x[rows], "int8x2", token_states=True, poison=77)
        for name in ("out", "out_q", "out_q_lo", "out_d", "token_conv_states", "token_states"):
            assert torch.equal(together[name][rows], alone[name]), (b, name)
        assert torch.equal(together["conv_state"][b], alone["conv_state"]), b
        assert torch.equal(together["state"][b], alone["state"]), b


@cuda
def test_batched_verify_graph_replay_equals_eager():
    """A batched verify (8 sequences of 4 tokens, token states kept) captured once and replayed from the same
    states: the eager bits."""
    T = 32
    inp = Inputs(T, SHAPE_27B, seed=8, sequences=8)
    want = run_step(inp, inp.x, "int8", token_states=True)
    o = inp.outputs(T, "int8", token_states=True, poison=-77)
    o.update(conv_state=inp.conv_state.clone(), state=inp.state.clone())

    def step():
        ops.gdn_step(inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS, o["conv_state"],
                     o["state"], o["out"], o["out_q"], None, o["out_d"], o["token_conv_states"], o["token_states"])

    graph = capture_graph(step)
    o["conv_state"].copy_(inp.conv_state)
    o["state"].copy_(inp.state)
    for name in ("out", "out_d", "token_conv_states", "token_states"):
        o[name].fill_(NAN)
    o["out_q"].fill_(77)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(o, want)


@cuda
def test_opcheck_cuda_batched_verify_rows():
    inp = Inputs(6, SHAPE_ORACLE, sequences=2)
    o = inp.outputs(6, "int8x2", True, poison=0)
    torch.library.opcheck(ops.gdn_step.default, (inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS,
                                                 inp.conv_state.clone(), inp.state.clone(), o["out"], o["out_q"],
                                                 o["out_q_lo"], o["out_d"], o["token_conv_states"], o["token_states"]))


@cuda
def test_opcheck_cuda():
    inp = Inputs(2, SHAPE_ORACLE)
    o = inp.outputs(2, "int8x2", True, poison=0)
    torch.library.opcheck(ops.gdn_step.default, (inp.x, inp.conv_weight, inp.a_neg, inp.dt_bias, inp.norm_weight, EPS,
                                                 inp.conv_state.clone(), inp.state.clone(), o["out"], o["out_q"],
                                                 o["out_q_lo"], o["out_d"], o["token_conv_states"], o["token_states"]))


def check_bad_inputs():
    """Every wrong argument raises a RuntimeError naming the op and the argument (run in a child process by
    test_bad_inputs_raise)."""
    inp = Inputs(2, SHAPE_ORACLE)
    batched = Inputs(2, SHAPE_ORACLE, batched=True)
    three = Inputs(3, SHAPE_ORACLE, batched=True)
    no_token_states = dict(token_conv_states=None, token_states=None)
    hk, hv, dk, dv = SHAPE_ORACLE

    def call(**changes):
        o = inp.outputs(2, "int8x2", True, poison=0)
        args = dict(x=inp.x, conv_weight=inp.conv_weight, a_neg=inp.a_neg, dt_bias=inp.dt_bias,
                    norm_weight=inp.norm_weight, eps=EPS, conv_state=inp.conv_state.clone(), state=inp.state.clone(),
                    out=o["out"], out_q=o["out_q"], out_q_lo=o["out_q_lo"], out_d=o["out_d"],
                    token_conv_states=o["token_conv_states"], token_states=o["token_states"])
        args.update(changes)
        ops.gdn_step(*args.values())

    cases = [
        ("at most 8 tokens", dict(x=torch.zeros(9, inp.x.shape[1], device="cuda"))),
        ("x must be Float", dict(x=inp.x.double())),
        ("x must be a CUDA tensor", dict(x=inp.x.cpu())),
        ("x must be \\[T, C \\+ Hv\\*dv \\+ 2\\*Hv\\]", dict(x=inp.x[:, :-1])),
        ("state must be contiguous float32", dict(state=inp.state.transpose(1, 2))),
        ("state must start 16-byte aligned", dict(state=torch.zeros(hv * dv * dk + 1, device="cuda")[1:].view(hv, dv, dk))),
        ("dv % 4 == 0", dict(state=torch.zeros(hv, 30, dk, device="cuda"))),
        ("conv_weight's K", dict(conv_weight=torch.zeros(inp.C, 9, device="cuda"))),
        ("must be 2\\*Hk\\*dk \\+ Hv\\*dv", dict(conv_weight=torch.zeros(inp.C + 1, 4, device="cuda"))),
        ("must be a multiple of Hk", dict(state=torch.zeros(5, dv, dk, device="cuda"),
                                          conv_weight=torch.zeros(2 * 3 * dk + 5 * dv, 4, device="cuda"))),
        ("conv_state must be", dict(conv_state=inp.conv_state[:2])),
        ("a_neg must be", dict(a_neg=inp.a_neg[:-1])),
        ("dt_bias is on", dict(dt_bias=inp.dt_bias.cpu())),
        ("norm_weight must be", dict(norm_weight=inp.norm_weight.double())),
        ("out must be", dict(out=torch.zeros(2, inp.Z + 1, device="cuda"))),
        ("out_q_lo needs out_q", dict(out_q=None, out_d=None)),
        ("out_q and out_d come together", dict(out_d=None)),
        ("out_d must be", dict(out_d=torch.zeros(2, inp.Z // 32 + 1, device="cuda"))),
        ("token_conv_states must be", dict(token_conv_states=torch.zeros(3, 3, inp.C, device="cuda"))),
        ("token_states must be", dict(token_states=torch.zeros(2, hv, dk, dv, device="cuda").transpose(2, 3))),
        ("token_states must start 16-byte aligned",
         dict(token_states=torch.zeros(2 * hv * dv * dk + 1, device="cuda")[1:].view(2, hv, dv, dk))),
        # batched rows: a state a sequence, B dividing x's rows, at most 8 tokens a sequence
        ("a 4-D state holds a sequence's state a row: .* dividing x's rows T = 2",
         dict(conv_state=three.conv_state.clone(), state=three.state.clone(), **no_token_states)),
        ("at most 8 tokens .* of a sequence, found 9 \\(x's rows / the states' B\\)",
         dict(x=torch.zeros(18, inp.x.shape[1], device="cuda"), conv_state=batched.conv_state.clone(),
              state=batched.state.clone(), out=torch.zeros(18, inp.Z, device="cuda"), out_q=None, out_q_lo=None,
              out_d=None, **no_token_states)),
        ("token_states must be", dict(conv_state=batched.conv_state.clone(), state=batched.state.clone(),
                                      token_states=torch.zeros(1, hv, dv, dk, device="cuda"))),
        ("conv_state must be contiguous float32 \\[2, 3, ", dict(state=batched.state.clone(), **no_token_states)),
        ("conv_state must be contiguous float32 \\[3, ", dict(conv_state=batched.conv_state.clone(),
                                                            **no_token_states)),
        ("state must be contiguous float32 \\[Hv, dv, dk\\], or", dict(state=batched.state[None].clone())),
        ("state must be contiguous float32", dict(state=batched.state.transpose(0, 1), **no_token_states)),
    ]
    for match, changes in cases:
        progress()
        print("case:", match, flush=True)
        with pytest.raises(RuntimeError, match="gdn_step: .*" + match):
            call(**changes)
    progress()
    narrow = Inputs(1, (1, 2, 32, 40))
    with pytest.raises(RuntimeError, match="gdn_step: the quantized lanes need dv % 32 == 0"):
        run_step(narrow, narrow.x, "int8", False)


@cuda
def test_bad_inputs_raise():
    """check_bad_inputs in a child process (see cuda_helpers.run_in_child for why), after the control."""
    run_in_child(__file__, "check_bad_inputs", preamble=TORCH_ERROR_CONTROL)
