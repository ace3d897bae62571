"""Stage partitioning: which global transformer layers each pipeline stage holds (pure).

The one home of this rule: the model stage builder (app.model.stage), and through it training,
inference and the checkpoint converter, all ask these functions.

Without interleaving stage r of PP holds one contiguous block of L / PP layers. With V model
chunks per stage (the interleaved schedule) the layers are cut into PP x V blocks of
L / (PP x V), handed out round-robin: block v x PP + r is chunk v of stage r, so stage 0 of
PP = 2, V = 2, L = 8 holds layers {0, 1} and {4, 5}, stage 1 holds {2, 3} and {6, 7}.
"""
from __future__ import annotations

from typing import List


def partition_layers(num_layers: int, pipeline_model_parallel_size: int) -> List[range]:
    """Split layers 0..num_layers-1 evenly into contiguous ranges, stage 0 first.

    Global indices are kept (stage 1 of 2 with 4 layers holds range(2, 4)), so parameter names
    do not depend on the pipeline size.
    """
    if pipeline_model_parallel_size <= 0:
        raise ValueError(f"pipeline_model_parallel_size must be positive, got "
                         f"{pipeline_model_parallel_size}")
    if num_layers <= 0 or num_layers % pipeline_model_parallel_size:
        raise ValueError(f"num_layers ({num_layers}) is not divisible by "
                         f"pipeline_model_parallel_size ({pipeline_model_parallel_size})")
    per_stage = num_layers // pipeline_model_parallel_size
    return [range(s * per_stage, (s + 1) * per_stage)
            for s in range(pipeline_model_parallel_size)]


def stage_layer_range(num_layers: int, pipeline_model_parallel_size: int,
                      pipeline_model_parallel_rank: int) -> range:
    """Global indices of the layers held by stage `pipeline_model_parallel_rank`."""
    if not 0 <= pipeline_model_parallel_rank < pipeline_model_parallel_size:
        raise ValueError(f"pipeline_model_parallel_rank ({pipeline_model_parallel_rank}) is not "
                         f"in [0, {pipeline_model_parallel_size})")
    return partition_layers(num_layers, pipeline_model_parallel_size)[pipeline_model_parallel_rank]


def stage_of_layer(num_layers: int, pipeline_model_parallel_size: int, layer: int) -> int:
    """The stage (without interleaving) that holds global layer `layer`."""
    for stage, layers in enumerate(partition_layers(num_layers, pipeline_model_parallel_size)):
        if layer in layers:
            return stage
    raise ValueError(f"layer {layer} is not in [0, num_layers={num_layers})")


def virtual_stage_layer_ranges(num_layers: int, pipeline_model_parallel_size: int,
                               virtual_pipeline_model_parallel_size: int,
                               pipeline_model_parallel_rank: int) -> List[range]:
    """Global layer indices of each model chunk of stage `pipeline_model_parallel_rank`, chunk 0
    first: chunk v holds block v x PP + rank of the PP x V equal blocks (Megatron's order)."""
    pp, vp = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    if vp <= 0:
        raise ValueError(f"virtual_pipeline_model_parallel_size must be positive, got {vp}")
    if not 0 <= pipeline_model_parallel_rank < max(pp, 1):
        raise ValueError(f"pipeline_model_parallel_rank ({pipeline_model_parallel_rank}) is not "
                         f"in [0, {pp})")
    blocks = partition_layers(num_layers, pp * vp)
    return [blocks[v * pp + pipeline_model_parallel_rank] for v in range(vp)]
