"""Tensor parallelism (qwen38_model/tensor_parallel.py, checkpoint/shard.py) on the CPU: each rank's shares of
the weights, then TP = 2 in two gloo processes (one spawned pair for the whole module) against TP = 1 in this
one, on the oracle (f32, HF bf16, Q8_0 in each lane) and on a model with the MTP block (plain and speculative
decode, sampling, two rows)."""
import dataclasses
import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen38_model import ConfigError, Qwen38ForCausalLM, convert, synthetic
from qwen38_model.checkpoint import Shard, open_checkpoint
from qwen38_model.checkpoint.layout import GLOBAL_PARTS, layer_parts

from numerics import rel_l2, row_rel_l2

# The MTP test models' shape (test_mtp.py's): attention at layers 1 and 3, the block is blk.4.
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "head_dim": 32,
         "linear_key_head_dim": 32, "linear_value_head_dim": 32, "full_attention_interval": 2}
NEW_TOKENS = 8


# ---- the shares, in this process ---------------------------------------------------------------------------

def test_a_shape_the_ranks_cannot_divide_names_the_field(oracle_dir):
    config = open_checkpoint(oracle_dir / "mini-f32.gguf").config
    with pytest.raises(ConfigError, match="num_key_value_heads 2 .* not a multiple of 4"):
        Shard(config, 0, 4)
    with pytest.raises(ConfigError, match="intermediate_size / ranks = 48 .* multiple of 32"):
        Shard(dataclasses.replace(config, intermediate_size=96), 0, 2)


def test_each_share_is_the_whole_tensors_rows_and_columns_in_both_layouts(oracle_dir):
    """Rank a's load from the GGUF and from the HF folder (the same bf16 values) are equal, and equal to the
    internal layout's rows/columns the shard says: the GGUF's tiled value heads, HF's grouped ones converted."""
    gguf, hf = open_checkpoint(oracle_dir / "mini-bf16.gguf"), open_checkpoint(oracle_dir / "hf")
    whole = open_checkpoint(oracle_dir / "mini-bf16.gguf")
    config = whole.config
    parts = [(p, None) for p in GLOBAL_PARTS] + [(p, i) for i in (0, 3) for p in layer_parts(config, i)]
    for rank in range(2):
        shard = Shard(config, rank, 2)
        gguf.use_shard(shard)
        hf.use_shard(Shard(hf.config, rank, 2))
        for part, layer in parts:
            args = (part, layer, "cpu", torch.float32, None)
            got, from_hf, full = gguf.load(*args), hf.load(*args), whole.load(*args)
            cut = shard.cut(part, gguf_layout=True)
            if cut is not None:
                full = torch.cat([full.narrow(cut.dim, start, stop - start) for start, stop in cut.ranges], cut.dim)
            assert torch.equal(got, full), (rank, part, layer)
            assert torch.equal(from_hf, got), (rank, part, layer)


# ---- TP = 2 in two processes ---------------------------------------------------------------------------------

def cases(load, paths: dict, ref: dict) -> dict:
    """What both sides compute: load(path, **kwargs) is a model at TP = 1 or a rank's at TP = 2."""
    prompt = ref["prompt_ids"].long()[None]
    out = {}
    for name, file, lane in (("f32", "mini-f32.gguf", "f32"), ("hf", "hf", "f32"), ("q8_f32", "mini-q8_0.gguf", "f32"),
                             ("q8_int8", "mini-q8_0.gguf", "int8"), ("q8_int8x2", "mini-q8_0.gguf", "int8x2")):
        model = load(paths["oracle"] / file, lane=lane)
        out[name] = model(prompt).logits[0]
        out[name + "_greedy"] = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    model = load(paths["mtp"], lane="int8")
    ids = paths["mtp_prompt"]
    out["mtp_logits"] = model(ids, return_mtp_logits=True).mtp_logits[0]
    out["mtp_greedy"] = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    out["mtp_speculative"] = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], speculative="mtp")
    out["mtp_sampled"] = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], do_sample=True, seed=7)
    out["mtp_two_rows"] = model.generate(ids.repeat(2, 1), max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                         do_sample=True, seed=3)
    # Unseeded: each rank draws, rank 0's draw is used (compared between the ranks, not with TP = 1).
    out["mtp_unseeded"] = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], do_sample=True)
    return out


def rank_main(rank: int, port: int, paths: dict, ref: dict, results: str) -> None:
    from qwen38_model import TensorParallelCausalLM  # the package's export

    torch.set_num_threads(1)  # two processes on the CI's two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A rank that fails leaves its partner in a collective: the timeout ends it (mp.spawn reports the failure).
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        out = cases(lambda path, **kw: TensorParallelCausalLM.from_pretrained(path, tensor_parallel=2, device="cpu",
                                                                              **kw), paths, ref)
        torch.save(out, f"{results}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def paths(oracle_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    hf = synthetic.write_hf_checkpoint(root / "hf", SMALL, seed=11, form="vlm")
    gguf = convert.hf_to_gguf(hf, root / "q8.gguf", "q8_0", model_name="tp", mtp=True)
    prompt = torch.randint(0, 500, (1, 13), generator=torch.Generator().manual_seed(3))
    return {"oracle": oracle_dir, "mtp": gguf, "mtp_prompt": prompt}


@pytest.fixture(scope="module")
def ref(oracle_dir):
    from safetensors.torch import load_file

    return load_file(oracle_dir / "ref.safetensors")


@pytest.fixture(scope="module")
def runs(paths, ref, tmp_path_factory):
    """(TP = 1's results, rank 0's, rank 1's)."""
    results = tmp_path_factory.mktemp("tp-results")
    mp.spawn(rank_main, args=(free_port(), paths, ref, str(results)), nprocs=2)
    one = cases(lambda path, **kw: Qwen38ForCausalLM.from_pretrained(path, device="cpu", **kw), paths, ref)
    return one, torch.load(results / "rank0.pt"), torch.load(results / "rank1.pt")


def test_ranks_hold_the_same_results(runs):
    _, rank0, rank1 = runs
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key


@pytest.mark.parametrize("name", ["f32", "hf", "q8_f32"])
def test_f32_lane_logits_within_1e5_of_one_process_and_the_same_tokens(runs, name):
    one, two, _ = runs
    err = rel_l2(two[name], one[name])
    print(f"{name}: TP=2 vs TP=1 rel L2 {err:.2e}")
    assert err <= 1e-5
    assert torch.equal(two[name + "_greedy"], one[name + "_greedy"])


def test_int8_lanes_tokens_equal_one_process(runs, ref):
    """The int8 lane quantizes the same blocks as one process; only a rounding flip after a partial sum's
    rounding changes a value (none on this model: the logits are the same bits). int8x2's grid is 127x finer,
    so flips happen (2e-4 here, the lane's own bar is 1e-3); the tokens hold."""
    one, two, _ = runs
    for name, bar in (("q8_int8", 1e-5), ("q8_int8x2", 1e-3)):
        err = float(row_rel_l2(two[name], one[name]).median())
        print(f"{name}: TP=2 vs TP=1 median row rel L2 {err:.2e}")
        assert err <= bar
        assert torch.equal(two[name + "_greedy"], one[name + "_greedy"])
    assert rel_l2(two["q8_int8x2"], ref["hf_logits_f32_from_q8gguf"]) <= 1e-3  # the lane's oracle bar at TP = 2


def test_mtp_block_plain_speculative_sampled_and_two_rows_equal_one_process(runs):
    one, two, _ = runs
    err = float(row_rel_l2(two["mtp_logits"], one["mtp_logits"]).median())
    print(f"MTP logits (int8): TP=2 vs TP=1 median row rel L2 {err:.2e}")
    assert err <= 1e-5
    for key in ("mtp_greedy", "mtp_speculative", "mtp_sampled", "mtp_two_rows"):
        assert torch.equal(two[key], one[key]), key
    assert torch.equal(one["mtp_speculative"], one["mtp_greedy"])
