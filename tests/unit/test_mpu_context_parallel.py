"""Context parallelism without processes: the rank layout against Megatron Core's
RankGenerator, the batch slicing against Megatron Core's get_batch_on_this_cp_rank, the ring's
block arithmetic (per-block causal masks, log-sum-exp merge and the recomputed backward,
simulated for every context rank) against PyTorch's causal SDPA and its autograd, the --dry-run
activation estimate at CP2 against the tensors autograd keeps, and the configuration errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app import mpu
from app.mpu.context_parallel import (block_backward, block_forward, block_plan,
                                      get_batch_on_this_cp_rank, merge_block, token_indices)
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
def test_ring_blocks_forward_and_recomputed_backward_equal_causal_attention(cp):
    """Every context rank simulated in this process, the blocks in the order the ring delivers
    them: the merged output and the gradients from the recomputed blocks (key/value gradients
    summed at their owner) equal PyTorch's causal SDPA and its autograd (float64)."""
    torch.manual_seed(0)
    b, n, s, hd = 2, 3, 4 * cp, 8
    q, k, v = (torch.randn(b, n, s, hd, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, s, hd]
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    local, scale = s // cp, hd ** -0.5
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        q_index = token_indices(local, cp, rank)
        qr, dout = q.detach()[:, :, q_index], grad_out[:, :, q_index]
        out = torch.zeros_like(qr)
        lse = torch.full(qr.shape[:3], -float("inf"), dtype=qr.dtype)
        blocks = []
        for step in range(cp):
            source = (rank - step) % cp
            k_index = token_indices(local, cp, source)
            rows, cols, masked = block_plan(cp, rank, source, local)
            kb, vb = k.detach()[:, :, k_index][:, :, cols], v.detach()[:, :, k_index][:, :, cols]
            merge_block(out, lse, rows, *block_forward(qr[:, :, rows], kb, vb, masked, scale,
                                                       None))
            blocks.append((rows, cols, masked, kb, vb, k_index))
        torch.testing.assert_close(out, want.detach()[:, :, q_index])
        delta = (dout * out).sum(-1)
        for rows, cols, masked, kb, vb, k_index in blocks:
            dq, dk, dv = block_backward(qr[:, :, rows], kb, vb, masked, scale, None,
                                        lse[:, :, rows], delta[:, :, rows], dout[:, :, rows])
            grads[0][:, :, q_index[rows]] += dq
            grads[1][:, :, k_index[cols]] += dk
            grads[2][:, :, k_index[cols]] += dv
    for name, got, expected in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got, expected, msg=lambda m, n=name: f"d{n}: {m}")


def test_block_backward_with_dropout_equals_autograd():
    """One block with a dropout factor: the recomputed backward equals autograd through the
    block's forward with the same factor (float64)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    masked = torch.arange(6).unsqueeze(0) > torch.arange(6).unsqueeze(1)
    keep = (torch.rand(2, 3, 6, 6) > 0.3).double() / 0.7
    out, lse = block_forward(q, k, v, masked, 0.5, keep)
    grad_out = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), grad_out)
    got = block_backward(q.detach(), k.detach(), v.detach(), masked, 0.5, keep, lse.detach(),
                         (grad_out * out.detach()).sum(-1), grad_out)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, msg=lambda m, n=name: f"d{n}: {m}")


def test_ring_function_in_row_tiles_with_gqa_and_dropout(monkeypatch):
    """The ring's autograd Function on one context rank, its scores in tiles of 3 query rows:
    equal to causal SDPA forward and backward with grouped queries, and with dropout its
    backward (recomputing the tiles' dropout factors) is the gradient of its forward
    (numerical gradcheck, the same seed for every call)."""
    from app.mpu import context_parallel
    monkeypatch.setattr(context_parallel, "ROW_TILE", 3)
    torch.manual_seed(0)
    state = ParallelState()
    q = torch.randn(2, 4, 8, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = context_parallel.ring_attention(q, k, v, state)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                          v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(got, want)
    grad_out = torch.randn_like(want)
    for name, g, w in zip("qkv", torch.autograd.grad(got, (q, k, v), grad_out),
                          torch.autograd.grad(want, (q, k, v), grad_out)):
        torch.testing.assert_close(g, w, msg=lambda m, n=name: f"d{n}: {m}")

    def dropped(*qkv):
        torch.manual_seed(1)
        return context_parallel.ring_attention(*qkv, state, dropout_p=0.3)
    small = [t.detach()[:1, :, :4].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(dropped, small)


@pytest.mark.parametrize("flags,needle", [
    (["--seq-length", "12", "--max-position-embeddings", "16"],
     "--seq-length (12) is not divisible by 2 x --context-parallel-size (8)"),
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
    the ring's fp32 output and log-sum-exp (no score block: backward recomputes them)."""
    from app.mpu import context_parallel
    from app.training.planning.memory import stage_activations
    from tests.harness.memory import config, saved_activation_bytes
    monkeypatch.setattr(context_parallel, "post_ring_shift", lambda x, state: (x.clone(), []))
    cfg = config("--context-parallel-size", "2", "--attention-dropout", "0", world=2)
    want = stage_activations(cfg, "cpu").forward * cfg.training.micro_batch_size
    got = saved_activation_bytes(cfg)
    assert abs(want - got) / got < 0.1, (want, got)
    single = config("--attention-dropout", "0")
    assert want < stage_activations(single, "cpu").forward * single.training.micro_batch_size


def test_distributed_optimizer_estimate_shards_over_data_x_context():
    """CP2 x DP2 holds 4 copies of the weights: the optimizer states are 1/4 of DP1's."""
    from app.training.planning.memory import estimate_memory
    from tests.harness.memory import config
    sharded = config("--context-parallel-size", "2", "--use-distributed-optimizer", world=4)
    whole = config()
    assert estimate_memory(sharded).optimizer * 4 == estimate_memory(whole).optimizer
