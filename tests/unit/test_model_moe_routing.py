"""MoE routing arithmetic (app.model.moe.routing) against values worked out by hand and against
Megatron Core 0.16.1's own functions (megatron.core.transformer.moe.moe_utils): top-k with
every score function, the load-balancing and z losses, capacity dropping and padding, the
expert-bias step, and the token permutation as a function of the routing map."""
from __future__ import annotations

import math

import pytest
import torch

from app.model.moe import routing

mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _logits(tokens: int = 24, experts: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def test_topk_softmax_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.7, 4.0]])
    probs, routing_map = routing.topk_routing(logits, 2)
    # row 0: experts 1 and 2, softmax over (3, 2); row 1: experts 3 and 2
    e = math.exp(1.0)
    assert routing_map.tolist() == [[False, True, True, False], [False, False, True, True]]
    torch.testing.assert_close(probs[0], torch.tensor([0.0, e / (e + 1), 1 / (e + 1), 0.0]))
    top = torch.softmax(torch.tensor([4.0, 0.7]), 0)
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.0, top[1], top[0]]))
    # pre-softmax: the full softmax's top two, not renormalised
    pre, _ = routing.topk_routing(logits, 2, pre_softmax=True)
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(pre[0, 1:3], full[0, 1:3])
    assert pre[0].sum() < 1.0


@pytest.mark.parametrize("score,pre,scale,bias", [
    ("softmax", False, None, False), ("softmax", True, None, False),
    ("softmax", False, 2.5, False), ("sigmoid", False, None, False),
    ("sigmoid", False, 1.5, True)])
@pytest.mark.parametrize("topk", [1, 2, 3])
def test_topk_equals_megatron(score, pre, scale, bias, topk):
    logits = _logits()
    expert_bias = torch.linspace(-0.3, 0.3, 6) if bias else None
    if topk == 1 and score == "softmax" and not pre:
        pre = True  # Megatron refuses a softmax over one selected logit
    ours = routing.topk_routing(logits, topk, score, pre, scale, expert_bias)
    theirs = mu.topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre, scaling_factor=scale, score_function=score,
        expert_bias=expert_bias)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    assert torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_scores_and_loss_equal_megatron(score):
    logits = _logits(32, 8, seed=1)
    scores, aux_map = routing.aux_loss_scores(logits, 2, score)
    their_map, their_scores = mu.compute_routing_scores_for_aux_loss(logits, 2, score)
    torch.testing.assert_close(scores, their_scores, rtol=0, atol=0)
    assert torch.equal(aux_map, their_map)
    counts = aux_map.sum(0).float()
    ours = routing.load_balancing_loss(scores, counts, 32, 2, 8, 1e-2)
    theirs = mu.switch_load_balancing_loss_func(scores, counts, 32, 2, 8, 1e-2)
    torch.testing.assert_close(ours, theirs)


def test_load_balancing_loss_by_hand_and_its_partials():
    # perfectly balanced: E f_i = 1 and sum_i P_i = 1 -> the loss equals the coefficient
    scores = torch.full((8, 4), 0.25)
    counts = torch.full((4,), 4.0)  # 8 tokens x top-2 / 4 experts
    assert routing.load_balancing_loss(scores, counts, 8, 2, 4, 0.1).item() == pytest.approx(0.1)
    # all on expert 0: loss = coeff E / (k T^2) * (T p0) * c0
    scores = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 4)
    counts = torch.tensor([4.0, 4.0, 0.0, 0.0])
    want = 1.0 * 4 / (2 * 16) * (4 * 0.7 * 4 + 4 * 0.1 * 4)
    assert routing.load_balancing_loss(scores, counts, 4, 2, 4, 1.0).item() == pytest.approx(want)
    # two ranks holding halves of the tokens, counts summed over both: the partials add up
    logits = _logits(16, 4, seed=3)
    full_scores, full_map = routing.aux_loss_scores(logits, 2, "softmax")
    total = routing.load_balancing_loss(full_scores, full_map.sum(0).float(), 16, 2, 4, 1e-2)
    halves = [routing.load_balancing_loss(full_scores[r * 8:(r + 1) * 8],
                                          full_map.sum(0).float(), 16, 2, 4, 1e-2)
              for r in (0, 1)]
    torch.testing.assert_close(halves[0] + halves[1], total)


def test_z_loss_by_hand_and_megatron():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    want = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2 * 1e-3
    assert routing.z_loss(logits, 1e-3).item() == pytest.approx(want)
    other = _logits(10, 5)
    torch.testing.assert_close(routing.z_loss(other, 3e-3), mu.z_loss_func(other, 3e-3))


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_capacity_equals_megatron(policy, pad, factor):
    probs, routing_map = routing.topk_routing(_logits(20, 4, seed=5), 2)
    ours = routing.drop_over_capacity(probs, routing_map, 2, factor, policy, pad)
    theirs = mu.apply_router_token_dropping(probs, routing_map, 2, factor, policy, pad)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    assert torch.equal(ours[1], theirs[1])


def test_capacity_by_hand():
    # 6 tokens, 2 experts, top-1, factor 1: capacity ceil(6 / 2) = 3 per expert
    assert routing.expert_capacity(6, 2, 1, 1.0) == 3
    assert routing.expert_capacity(10, 4, 2, 1.25) == 7
    probs = torch.tensor([[0.9, 0.0], [0.8, 0.0], [0.7, 0.0], [0.6, 0.0], [0.0, 0.5],
                          [0.95, 0.0]])
    kept_probs, kept = routing.drop_over_capacity(probs, probs > 0, 1, 1.0, "probs")
    assert kept[:, 0].tolist() == [True, True, False, False, False, True]  # 0.9, 0.8, 0.95
    assert kept[:, 1].tolist() == [False, False, False, False, True, False]
    assert kept_probs[3, 0] == 0.0
    _, padded = routing.drop_over_capacity(probs, probs > 0, 1, 1.0, "probs", pad=True)
    assert padded.sum(0).tolist() == [3, 3]  # exactly the capacity, extra rows at prob 0


def test_expert_bias_update_by_hand():
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0])
    tokens = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    new = routing.expert_bias_update(bias, tokens, 1e-2)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.11, -0.09, 0.01]))


def test_permutation_is_the_routing_map_and_equals_megatron():
    hidden = torch.randn(10, 3, generator=torch.Generator().manual_seed(7))
    probs, routing_map = routing.topk_routing(_logits(10, 4, seed=8), 2)
    token_index, counts = routing.sort_by_expert(routing_map)
    # by hand: expert by expert, each one's tokens in ascending order
    want = [t for e in range(4) for t in range(10) if routing_map[t, e]]
    assert token_index.tolist() == want
    assert counts == routing_map.sum(0).tolist()
    rows = hidden.index_select(0, token_index)
    permuted, permuted_probs, sorted_indices = mu.permute(hidden, routing_map, probs=probs)
    assert torch.equal(rows, permuted) and torch.equal(token_index, sorted_indices)
    torch.testing.assert_close(routing.sorted_probs(probs, routing_map), permuted_probs)
    # unsort: every pair's row summed back into its token
    back = routing.unsort(rows * 2.0, token_index, 10)
    torch.testing.assert_close(back, hidden * 2.0 * routing_map.sum(1, keepdim=True))
    torch.testing.assert_close(back, mu.unpermute(rows * 2.0, sorted_indices, hidden.shape))
