"""One pipeline stage of GPT-2 for a parallel layout, and the record of each parameter it holds.

`build_model_stage` is the one place a model stage is put together from a ModelConfig and a
ParallelState: which layers it holds (`app.pipeline.partition`), whether it embeds (first
stage) and has the head (last stage), and its model chunks under the interleaved schedule.
Training (`app.training.run`), inference (`app.inference.runner`) and the converter (through
`stage_parameters`) all build stages with it.

`parameter_records` reads what a model declares about each parameter: its global name, its
shape, the dimension tensor parallelism splits it along, its global layer index. The split
dimension is stated once, by the marks the parallel layers put on the parameters they cut
(`app.mpu.layers.set_tensor_model_parallel_attributes`: ColumnParallelLinear and
VocabParallelEmbedding rows, RowParallelLinear columns, LayerNorms, row-parallel biases and the
position table replicated); nothing else restates it. `stage_parameters` gives the records of a
stage that is built on the meta device at TP 1 (no memory, no arithmetic), so its shapes are
the full (global) ones: what the checkpoint converter splits and merges by.

A checkpoint format that names parameters differently (Megatron Core's `torch_dist`, whose
ShardedTensors have a global key, a global shape and this rank's offsets) adds its own table
beside these records, keyed by our name with the layer index taken out (`ParameterRecord.layer`
is not None: one tensor stacked over the layers, the layer its offset on a leading axis), and
reads the shape and the split dimension from the records instead of restating them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from app.config import ModelConfig
from app.config.param_names import parse_layer
from app.model.gpt2 import GPT2Model
from app.mpu.parallel_state import ParallelState
from app.pipeline.chunks import ModelChunks
from app.pipeline.partition import virtual_stage_layer_ranges


def build_model_stage(config: ModelConfig, parallel_state: ParallelState,
                      virtual_pipeline_model_parallel_size: int = 1) -> nn.Module:
    """The GPT-2 stage that pipeline rank `parallel_state.pipeline_model_parallel_rank` holds
    (the whole model with one stage), on the current default device.

    With V > 1 virtual stages (interleaved 1F1B) the stage is V model chunks (chunk v holds
    virtual stage v x PP + rank) as one ModelChunks; chunk 0 of the first stage embeds and
    chunk V - 1 of the last stage has the head. Parameter names use global layer indices.
    """
    pp = parallel_state.pipeline_model_parallel_size
    stage = parallel_state.pipeline_model_parallel_rank
    vp = virtual_pipeline_model_parallel_size
    ranges = virtual_stage_layer_ranges(config.num_layers, pp, vp, stage)
    chunks = [GPT2Model(config, parallel_state, pre_process=stage == 0 and v == 0,
                        post_process=stage == pp - 1 and v == vp - 1,
                        layer_range=(layers.start, layers.stop))
              for v, layers in enumerate(ranges)]
    return chunks[0] if vp == 1 else ModelChunks(chunks)


@dataclass(frozen=True)
class ParameterRecord:
    """One parameter as the model declares it."""

    name: str
    """Our global name (Megatron's, global layer index; docs/architecture.md)."""
    shape: Tuple[int, ...]
    """As the module holds it: the full shape at TP 1 (`stage_parameters`), this rank's shard
    otherwise."""
    partition_dim: int
    """The dimension tensor parallelism splits it along in contiguous equal shards (0 rows,
    1 columns), or -1 when every TP rank holds all of it."""
    layer: Optional[int]
    """Global index of the transformer layer holding it; None outside the layers."""
    tied_copy: bool
    """The last stage's copy of the word embeddings (kept equal to stage 0's)."""
    glu_halves: bool = False
    """--swiglu's first projection: rows [gate; up], each half split over TP, so a rank holds
    [gate_r; up_r] (app.checkpoint.sharding.place)."""
    expert: bool = False
    """An MoE layer's routed experts [E, ...]: dim 0 split over the expert-parallel ranks, the
    `partition_dim` split over the expert tensor-parallel ones (app.model.moe.experts)."""


def parameter_records(model: nn.Module) -> Dict[str, ParameterRecord]:
    """The record of every parameter of `model` (a stage, its chunks, a meta-device build), in
    module order (= its state_dict and optimizer order), read from the parameters' own marks.

    Raises ValueError naming a parameter that carries no tensor-parallel mark.
    """
    records: Dict[str, ParameterRecord] = {}
    for name, param in model.named_parameters():
        if not hasattr(param, "tensor_model_parallel"):
            raise ValueError(f"parameter {name} carries no tensor-parallel mark: its layer must "
                             "call app.mpu.layers.set_tensor_model_parallel_attributes")
        dim = param.partition_dim if param.tensor_model_parallel else -1
        parsed = parse_layer(name)
        records[name] = ParameterRecord(name=name, shape=tuple(param.shape), partition_dim=dim,
                                        layer=parsed[0] if parsed else None,
                                        tied_copy=bool(getattr(param, "shared", False)),
                                        glu_halves=bool(getattr(param, "glu_halves", False)),
                                        expert=getattr(param, "expert_axis", None) is not None)
    return records


def stage_parameters(config: ModelConfig, pipeline_model_parallel_size: int = 1,
                     stage: int = 0) -> Dict[str, ParameterRecord]:
    """The records of pipeline stage `stage` of `pipeline_model_parallel_size` (no
    interleaving), with full shapes: the stage built on the meta device at TP 1.

    Raises ValueError when the layers do not divide into the stages (app.pipeline.partition).
    """
    pp = pipeline_model_parallel_size
    layout = ParallelState(pipeline_model_parallel_size=pp, pipeline_model_parallel_rank=stage,
                           pipeline_ranks=list(range(pp)))
    with torch.device("meta"):
        return parameter_records(build_model_stage(config, layout))
