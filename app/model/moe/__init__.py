"""Mixture of Experts, as Megatron Core builds it, in three parts with one job each:

    routing.py     pure routing arithmetic (top-k, load-balancing and z losses, capacity)
    router.py      TopKRouter: the router weight, its losses and what it records for the log
    dispatcher.py  the token dispatchers (allgather, alltoall): the only communication
    experts.py     GroupedExperts: this rank's experts as 3-D weights, local matmuls
    layer.py       MoELayer (router + dispatcher + experts + shared expert), and what an engine
                   calls around an iteration (begin_iteration, update_expert_bias)
    metrics.py     the MoE log: losses and tokens per expert reduced over the ranks

docs/moe.md explains the flags and the parallel layouts.
"""
from app.model.moe.layer import MoELayer, begin_iteration, moe_layers, update_expert_bias
from app.model.moe.metrics import MoEMetrics

__all__ = ["MoELayer", "MoEMetrics", "begin_iteration", "moe_layers",
           "update_expert_bias"]
