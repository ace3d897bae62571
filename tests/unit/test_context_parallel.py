"""Context parallelism without processes: the rank layout against Megatron Core's
RankGenerator, the batch slicing against Megatron Core's get_batch_on_this_cp_rank, the ring's
block arithmetic (per-block causal masks and log-sum-exp merge, simulated for every context
rank) against PyTorch's causal SDPA, the --dry-run activation estimate at CP2 against the
tensors autograd keeps, and the configuration errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app import mpu
from app.mpu.context_parallel import (block_attention, get_batch_on_this_cp_rank,
                                      merge_blocks, ring_block, token_indices)
from app.mpu.parallel_state import ParallelState

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "4"]


def _sorted_groups(groups):
    return sorted(sorted(g) for g in groups)


@pytest.mark.parametrize("world,tp,cp,pp", [(8, 2, 2, 1), (16, 2, 2, 2), (8, 1, 2, 2),
                                            (12, 1, 3, 2), (8, 2, 4, 1)])
def test_rank_layout_matches_megatron_core_rank_generator(world, tp, cp, pp):
    from megatron.core.parallel_state import RankGenerator
    dp = world // (tp * cp * pp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    layout = mpu.rank_layout(world, tp, pp, cp)
    for ours, theirs in (("tensor", "tp"), ("context", "cp"), ("data", "dp"),
                         ("data_context", "dp-cp"), ("pipeline", "pp"), ("model", "tp-pp")):
        assert _sorted_groups(layout[ours]) == _sorted_groups(gen.get_ranks(theirs)), ours
    # ring neighbours: a context group lists its ranks in context-rank order
    for group in layout["context"]:
        assert group == sorted(group)


@pytest.mark.parametrize("cp", [2, 3])
def test_batch_slicing_matches_megatron_core(cp, monkeypatch):
    import megatron.core.utils as mcore_utils
    s, b = 12 * cp, 2
    batch = {"tokens": torch.randint(0, 50, (b, s)), "labels": torch.randint(0, 50, (b, s)),
             "loss_mask": torch.rand(b, s), "position_ids": torch.arange(s).expand(b, s),
             "attention_mask": None}
    for rank in range(cp):
        monkeypatch.setattr(mcore_utils.parallel_state, "get_context_parallel_world_size",
                            lambda: cp)
        monkeypatch.setattr(mcore_utils.parallel_state, "get_context_parallel_rank",
                            lambda r=rank: r)
        want = mcore_utils.get_batch_on_this_cp_rank(dict(batch))
        state = ParallelState(context_parallel_size=cp, context_parallel_rank=rank)
        got = get_batch_on_this_cp_rank(dict(batch), state)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
        # the position ids are the tokens' global indices
        assert got["position_ids"][0].tolist() == token_indices(s // cp, cp, rank).tolist()


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_blocks_merged_by_log_sum_exp_equal_causal_attention(cp):
    torch.manual_seed(0)
    b, n, s, hd = 2, 3, 4 * cp, 8
    q, k, v = (torch.randn(b, n, s, hd, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, s, hd]
    local = s // cp
    for rank in range(cp):
        q_index = token_indices(local, cp, rank)
        outs, lses = [], []
        for step in range(cp):  # the blocks in the order the ring delivers them
            source = (rank - step) % cp
            k_index = token_indices(local, cp, source)
            out, lse = ring_block(q[:, :, q_index], k[:, :, k_index], v[:, :, k_index], cp,
                                  rank, source, hd ** -0.5, 0.0)
            outs.append(out)
            lses.append(lse)
            # the half-blocks it skips are the fully masked ones: the masked full block agrees
            masked = k_index.unsqueeze(0) > q_index.unsqueeze(1)
            full_out, full_lse = block_attention(q[:, :, q_index], k[:, :, k_index],
                                                 v[:, :, k_index], masked, hd ** -0.5, 0.0)
            seen = ~masked.all(dim=1)  # query rows with any key of this block
            torch.testing.assert_close(out[:, :, seen], full_out[:, :, seen])
            torch.testing.assert_close(lse[:, :, seen], full_lse[:, :, seen])
            assert (lse[:, :, ~seen] == torch.finfo(lse.dtype).min).all()
        torch.testing.assert_close(merge_blocks(outs, lses), want[:, :, q_index])


@pytest.mark.parametrize("flags,needle", [
    (["--seq-length", "12", "--max-position-embeddings", "16"],
     "--seq-length (12) is not divisible by 2 x --context-parallel-size (8)"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2"),
    (["--position-embedding-type", "alibi"], "--position-embedding-type alibi"),
    (["--reset-attention-mask"], "--reset-attention-mask"),
    (["--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "2"],
     "--num-query-groups (2) / --tensor-model-parallel-size (1) is not divisible by "
     "--context-parallel-size (4)"),
])
def test_unsupported_context_parallel_options_name_both_values(flags, needle):
    import arguments
    with pytest.raises((ValueError, SystemExit)) as err:
        arguments.config_from_argv(BASE + ["--context-parallel-size", "4"] + flags, 8, 64)
    assert needle in str(err.value) and "--context-parallel-size" in str(err.value)


def test_world_not_divisible_by_context_names_the_sizes():
    import arguments
    with pytest.raises((ValueError, SystemExit)) as err:
        arguments.config_from_argv(BASE + ["--context-parallel-size", "4"], 6, 64)
    assert "--context-parallel-size (4)" in str(err.value)


def test_activation_estimate_at_cp2_matches_the_tensors_autograd_keeps(monkeypatch):
    """One context rank's forward in this process (the ring's shift hands back a copy of the
    rank's own keys/values, which is what a received block costs): s/C tokens per layer plus
    the ring blocks' fp32 scores and probabilities."""
    from app.mpu import context_parallel
    from app.training.planning.memory import stage_activations
    from tests.unit.test_memory_estimate import config, saved_activation_bytes
    monkeypatch.setattr(context_parallel, "ring_shift", lambda x, state: x.clone())
    cfg = config("--context-parallel-size", "2", "--attention-dropout", "0", world=2)
    want = stage_activations(cfg, "cpu").forward * cfg.training.micro_batch_size
    got = saved_activation_bytes(cfg)
    assert abs(want - got) / got < 0.1, (want, got)
    single = config("--attention-dropout", "0")
    assert want < stage_activations(single, "cpu").forward * single.training.micro_batch_size


def test_distributed_optimizer_estimate_shards_over_data_x_context():
    """CP2 x DP2 holds 4 copies of the weights: the optimizer states are 1/4 of DP1's."""
    from app.training.planning.memory import estimate_memory
    from tests.unit.test_memory_estimate import config
    sharded = config("--context-parallel-size", "2", "--use-distributed-optimizer", world=4)
    whole = config()
    assert estimate_memory(sharded).optimizer * 4 == estimate_memory(whole).optimizer
