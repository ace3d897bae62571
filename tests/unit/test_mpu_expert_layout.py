"""The expert grid of Mixture of Experts (app.mpu.parallel_state.expert_rank_layout) against
Megatron Core 0.16.1's RankGenerator, as its initialize_model_parallel builds it: the expert
generator RankGenerator(tp=ETP, ep=EP, dp=EDP, pp=PP, cp=1) and the dense one for the
tensor x context and tensor x data x context groups, in the order tp-cp-ep-dp-pp."""
from __future__ import annotations

import pytest

from app import mpu


def _sorted_groups(groups):
    return sorted(sorted(g) for g in groups)


LAYOUTS = [  # world, tp, cp, pp, ep, etp
    (2, 1, 1, 1, 2, 1), (2, 2, 1, 1, 1, 2), (4, 2, 1, 1, 2, 2), (4, 1, 1, 2, 2, 1),
    (2, 1, 2, 1, 2, 1), (4, 1, 2, 1, 2, 1), (2, 2, 1, 1, 1, 1), (4, 2, 1, 1, 1, 1),
    (4, 1, 1, 1, 1, 2), (16, 2, 2, 2, 4, 1), (64, 4, 2, 2, 8, 2), (32, 2, 1, 4, 8, 1),
]


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", LAYOUTS)
def test_expert_groups_match_megatron_core_rank_generator(world, tp, cp, pp, ep, etp):
    from megatron.core.parallel_state import RankGenerator
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    layout = mpu.expert_rank_layout(world, tp, pp, cp, ep, etp)
    for ours, generator, token in (
            ("expert_tensor", expert, "tp"), ("expert", expert, "ep"),
            ("expert_tensor_and_expert", expert, "tp-ep"), ("expert_data", expert, "dp"),
            ("expert_model", expert, "tp-ep-pp"), ("tensor_context", dense, "tp-cp"),
            ("tensor_data_context", dense, "tp-cp-dp")):
        assert _sorted_groups(layout[ours]) == _sorted_groups(generator.get_ranks(token)), ours
    # both grids share the pipeline groups (Megatron asserts it)
    assert _sorted_groups(expert.get_ranks("pp")) == _sorted_groups(dense.get_ranks("pp"))
    # a group's rank order is its global rank order: the dispatchers' rank = etp + ETP x ep
    for group in layout["expert_tensor_and_expert"]:
        assert group == sorted(group)


def test_expert_layout_refuses_a_world_the_grid_does_not_divide():
    with pytest.raises(ValueError, match=r"world_size \(6\) is not divisible by "
                                         r"expert_tensor_model_pipeline_parallel size \(4\)"):
        mpu.expert_rank_layout(6, 1, 1, 1, 4, 1)
