"""Where each parameter of our GPT models lives in a TP x PP layout, for the converter: no
files, no processes.

Names are ours (Megatron's, flat, global layer indices; see docs/architecture.md). What each
pipeline stage holds, in module order, and the dimension tensor parallelism splits each
parameter along are not restated here: `Layout` reads them from the model itself
(`app.model.stage.stage_parameters`, a stage built on the meta device, and the marks its
parallel layers put on each parameter). Where a TP shard lies in the full tensor is the one
rule the torch_dist format uses too (`app.checkpoint.sharding.place`): contiguous chunks along
that dimension (the fused QKV rows are ordered by query group, so a chunk holds whole groups),
and under grouped-query attention with fewer key/value groups than TP ranks, each rank's query
rows plus its group's key/value rows, shared by the ranks of that group; SwiGLU's first
projection (--swiglu) is [gate; up] in full and [gate_r; up_r] on rank r, as Megatron splits it.
An MoE layer's experts [E, ...] are split over the expert-parallel ranks along dim 0 (rank e holds
experts [e E/EP, (e + 1) E/EP)), and each expert over the expert tensor-parallel ranks as its
marks say (`split_experts`; `shard` gives a rank of any layout its part of any parameter).
The Llama block's other parameters (RMSNorm weights, QK-norms, no biases) are whatever the
model built from the config holds. Merging places the shards back (checking that shared rows
agree), so split/merge round trips are exact.
`merge_ranks` merges every rank's flat dict of a whole checkpoint; `target_args` and
`target_padded_vocab` give a written checkpoint's args at its target layout.
"""
from __future__ import annotations

import argparse
import copy
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from app.checkpoint import CheckpointError, sharding
from app.checkpoint.model_args import (ROPE_FACTOR_APPLIED, converted_writer_record,
                                       model_config_from_args,
                                       model_option_args)
from app.checkpoint.state import Iteration, ModelCheckpoint, Progress
from app.config import ModelConfig
from app.config.param_names import (FINAL_NORM, OUTPUT_LAYER, POSITION_EMBEDDINGS, TIED_HEAD,
                                    WORD_EMBEDDINGS, layer_param_name, parse_layer)
from app.data import pad_vocab_size
from app.model.stage import ParameterRecord, build_model_stage, stage_parameters
from app.mpu.parallel_state import ParallelState
from app.optim.param_groups import get_muon_param_groups, get_param_groups

__all__ = ["FINAL_NORM", "OUTPUT_LAYER", "POSITION_EMBEDDINGS", "TIED_HEAD", "VOCABULARY",
           "WORD_EMBEDDINGS", "Layout", "LayoutError", "layer_param_name", "merge_shards",
           "merge_ranks", "parse_layer", "pad_vocabulary", "resize_vocab", "split_tensor",
           "target_args", "target_padded_vocab"]

logger = logging.getLogger(__name__)

VOCABULARY = (WORD_EMBEDDINGS, OUTPUT_LAYER)
"""The full tensors whose rows are the padded vocabulary (the tied copy is the first's)."""


class LayoutError(ValueError):
    """A parameter name or shape that the GPT-2 layout cannot place; the message names it."""


class Layout:
    """The parameters of one model split over `pipeline_model_parallel_size` stages (no
    interleaving): each stage's names in module order (= its state_dict and optimizer order)
    and each parameter's record, as the model built from `config` holds them.

    Stage 0 holds the embeddings, stage s the layers app.pipeline.partition gives it, the last
    stage the final LayerNorm (and the output layer, or with PP > 1 and tied embeddings the
    copy `word_embeddings.weight`). Raises LayoutError when the layers do not divide into the
    stages.
    """

    def __init__(self, config: ModelConfig, pipeline_model_parallel_size: int) -> None:
        pp = pipeline_model_parallel_size
        try:
            self.stages = [stage_parameters(config, pp, stage) for stage in range(pp)]
        except ValueError as exc:  # the layers do not divide into the stages
            raise LayoutError(str(exc)) from exc
        self._stage_of = {name: stage for stage, records in enumerate(self.stages)
                          for name in records}
        self.config = config
        self._groups: Dict[bool, Dict[str, str]] = {}

    @classmethod
    def of_args(cls, args: argparse.Namespace, pipeline_model_parallel_size: int,
                padded_vocab_size: Optional[int] = None) -> "Layout":
        """The layout of the model a checkpoint's `args` describe, with `padded_vocab_size`
        rows when given (raises CheckpointError when the args lack the model's shape)."""
        config = model_config_from_args(args, padded_vocab_size, for_inference=True)
        return cls(config, pipeline_model_parallel_size)

    def stage_names(self, stage: int) -> List[str]:
        """Parameter names of `stage`, in module order."""
        return list(self.stages[stage])

    def names(self) -> List[str]:
        """Every stage's names, stage 0 first (with the last stage's tied copy, if any)."""
        return list(self._stage_of)

    def record(self, name: str) -> ParameterRecord:
        """The record of `name`; LayoutError for a name this model does not have."""
        stage = self.stage_of(name)
        return self.stages[stage][name]

    def replicated_rows(self, name: str, tp: int) -> Optional[Tuple[int, int]]:
        """(first_row, ranks): the rows [first_row:] of `name`'s TP shard that `ranks` ranks
        share at tensor-parallel size `tp` (the fused QKV weight and bias under grouped-query
        attention with fewer key/value groups than ranks, app.model.attention); else None."""
        groups, heads = self.config.num_kv_heads, self.config.num_attention_heads
        if groups >= tp or (parse_layer(name) or (0, ""))[1] not in FUSED_QKV:
            return None
        return heads // tp * self.config.head_dim, tp // groups

    def split(self, name: str, full: torch.Tensor, tp: int) -> List[torch.Tensor]:
        """The `tp` shards of parameter `name` (split_tensor with its shared rows)."""
        return split_tensor(full, self.record(name), tp, self.replicated_rows(name, tp))

    def merge(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor of parameter `name` from its TP shards (merge_shards)."""
        return merge_shards(shards, self.record(name), self.replicated_rows(name, len(shards)))

    def is_expert(self, name: str) -> bool:
        """Whether `name` is an MoE layer's routed-expert weight (split by `split_experts`)."""
        return self.record(name).expert

    def split_experts(self, name: str, full: torch.Tensor, ep: int, etp: int
                      ) -> List[List[torch.Tensor]]:
        """An expert weight's shards [ep_rank][etp_rank]: its E experts in EP contiguous groups
        along dim 0, each split over ETP ranks (split_tensor: [gate_r; up_r] for fc1)."""
        if full.shape[0] % ep:
            raise LayoutError(f"{name}: {full.shape[0]} experts do not split over the "
                              f"expert-parallel size {ep}")
        return [split_tensor(group, self.record(name), etp) for group in full.chunk(ep)]

    def merge_experts(self, name: str, shards: Sequence[Sequence[torch.Tensor]]
                      ) -> torch.Tensor:
        """Inverse of split_experts: shards [ep_rank][etp_rank] -> the full [E, ...] weight."""
        return torch.cat([merge_shards(row, self.record(name)) for row in shards])

    def shard(self, name: str, full: torch.Tensor, parallel_state: ParallelState
              ) -> torch.Tensor:
        """The part of the full tensor of `name` that a rank of `parallel_state` holds: its
        tensor-parallel shard, or for an expert weight its expert-parallel rank's experts split
        over the expert tensor-parallel ranks."""
        ps = parallel_state
        if self.is_expert(name):
            return self.split_experts(name, full, ps.expert_model_parallel_size,
                                      ps.expert_tensor_parallel_size
                                      )[ps.expert_model_parallel_rank][
                                          ps.expert_tensor_parallel_rank]
        return self.split(name, full, ps.tensor_model_parallel_size
                          )[ps.tensor_model_parallel_rank]

    def optimizer_groups(self, names: Sequence[str], muon: bool = False) -> Dict[str, List[str]]:
        """{group name: the `names` in it, in their order}, groups in the optimizer's order:
        the model's own groups (app.optim.get_param_groups; with `muon`,
        get_muon_param_groups), asked of each stage built on the meta device."""
        if muon not in self._groups:
            self._groups[muon] = self._model_groups(muon)
        group_of = self._groups[muon]
        unknown = [n for n in names if n not in group_of]
        if unknown:
            self.stage_of(unknown[0])  # LayoutError naming it
        order = list(dict.fromkeys(group_of.values()))
        return {group: [n for n in names if group_of[n] == group] for group in order}

    def group_of(self, name: str) -> str:
        """The name of the model's own optimizer group (decay or no_decay) holding `name`."""
        return next(g for g, members in self.optimizer_groups([name]).items() if members)

    def _model_groups(self, muon: bool) -> Dict[str, str]:
        """{parameter name: its optimizer group's name} over every stage of the model."""
        pp = len(self.stages)
        found: Dict[str, str] = {}
        for stage in range(pp):
            ps = ParallelState(pipeline_model_parallel_size=pp, pipeline_model_parallel_rank=stage,
                               pipeline_ranks=list(range(pp)))
            with torch.device("meta"):
                module = build_model_stage(self.config, ps)
            name_of = {id(p): n for n, p in module.named_parameters()}
            groups = get_muon_param_groups(module, {}) if muon else get_param_groups(module)
            found.update({name_of[id(p)]: g["name"] for g in groups for p in g["params"]})
        return found

    def stage_of(self, name: str) -> int:
        """The pipeline stage holding `name`; LayoutError for a name this model does not have."""
        if name not in self._stage_of:
            raise LayoutError(f"parameter {name!r} is not part of this GPT-2 model (expected "
                              "language_model.embedding.*, language_model.transformer.layers.N.*, "
                              "language_model.transformer.final_layernorm.*, "
                              "language_model.output_layer.weight or word_embeddings.weight)")
        return self._stage_of[name]


def _shard_shape(full: Sequence[int], dim: int, tp: int,
                 replicated_rows: Optional[Tuple[int, int]], name: str) -> Tuple[int, ...]:
    """The shape of one TP shard of a tensor of shape `full` (see sharding.place)."""
    full = tuple(int(s) for s in full)
    if replicated_rows is not None:
        first_row, ranks = replicated_rows
        sets = tp // ranks  # groups of ranks, each holding one set of shared rows
        if full[0] % sets:
            raise LayoutError(f"{name}: {full[0]} rows do not split into {sets} key/value groups")
        return (full[0] // sets - (ranks - 1) * first_row,) + full[1:]
    if full[dim] % tp:
        raise LayoutError(f"{name}: dimension {dim} of shape {full} is not divisible by the "
                          f"tensor-parallel size {tp}")
    return full[:dim] + (full[dim] // tp,) + full[dim + 1:]


def _box(start: Sequence[int], size: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, size))


def _placements(full_shape: Sequence[int], record: ParameterRecord, tp: int,
                replicated_rows: Optional[Tuple[int, int]]) -> List[sharding.Placement]:
    """Each TP rank's placement of its shard in the full tensor (sharding.place)."""
    local = _shard_shape(full_shape, record.partition_dim, tp, replicated_rows, record.name)
    found = [sharding.place(record.name, local, partition_dim=record.partition_dim, tp_rank=rank,
                            tp_size=tp, replicated_rows=replicated_rows,
                            glu_halves=record.glu_halves) for rank in range(tp)]
    if found[0].global_shape != tuple(full_shape):
        raise LayoutError(f"{record.name}: shards of {local} place into "
                          f"{found[0].global_shape}, not the full shape {tuple(full_shape)}")
    return found


def split_tensor(full: torch.Tensor, record: ParameterRecord, tp: int,
                 replicated_rows: Optional[Tuple[int, int]] = None) -> List[torch.Tensor]:
    """The `tp` shards of `full` as the TP ranks hold them (replicas when partition_dim is -1):
    the boxes sharding.place gives, with `replicated_rows` (Layout.replicated_rows) shared."""
    if record.partition_dim < 0 or tp == 1:
        return [full] * tp
    shards = []
    for placement in _placements(full.shape, record, tp, replicated_rows):
        local = _shard_shape(full.shape, record.partition_dim, tp, replicated_rows, record.name)
        shard = full.new_empty(local)
        for region in placement.regions:
            shard[_box(region.local_start, region.size)] = \
                full[_box(region.global_offset, region.size)]
        shards.append(shard)
    return shards


def merge_shards(shards: Sequence[torch.Tensor], record: ParameterRecord,
                 replicated_rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Inverse of split_tensor: each shard placed back (sharding.place); replicas and shared
    rows must agree (LayoutError naming the rank otherwise)."""
    tp = len(shards)
    if record.partition_dim < 0 or tp == 1:
        first = shards[0]
        for rank, other in enumerate(shards[1:], start=1):
            if other.shape != first.shape or not torch.equal(other, first):
                raise LayoutError(f"{record.name} is replicated across tensor-parallel ranks but "
                                  f"rank {rank}'s copy differs from rank 0's")
        return first
    first_row, ranks = replicated_rows or (0, 1)
    sets = tp // ranks
    rows = sets * (ranks * first_row + shards[0].shape[0] - first_row) if replicated_rows \
        else None
    dim = record.partition_dim
    shape = list(shards[0].shape)
    shape[0 if rows else dim] = rows if rows else shape[dim] * tp
    full = shards[0].new_empty(shape)  # [full rows or columns of the parameter]
    for rank, placement in enumerate(_placements(shape, record, tp, replicated_rows)):
        for region in placement.regions:
            piece = shards[rank][_box(region.local_start, region.size)]
            target = _box(region.global_offset, region.size)
            if region.copy_index and not torch.equal(full[target], piece):
                raise LayoutError(f"{record.name}: tensor-parallel rank {rank}'s copy of the "
                                  "key/value rows it shares differs from its group's first rank's")
            full[target] = piece
    return full


FUSED_QKV = ("attention.query_key_value.weight", "attention.query_key_value.bias")
"""The layer parameters whose key/value rows grouped-query attention may share over TP ranks."""


def resize_vocab(tensor: torch.Tensor, rows: int, vocab_size: Optional[int], name: str
                 ) -> torch.Tensor:
    """`tensor` [V, ...] with `rows` rows: padding rows appended as zeros, or dropped.

    Only padding rows (index >= vocab_size, the tokenizer's size) may be dropped; a request
    that would cut real tokens raises LayoutError naming the sizes.
    """
    have = tensor.shape[0]
    if rows == have:
        return tensor
    if rows < have:
        if vocab_size is not None and rows < vocab_size:
            raise LayoutError(f"{name}: cannot shrink the vocabulary to {rows} rows; the "
                              f"tokenizer has {vocab_size} tokens")
        return tensor[:rows].clone()
    pad = torch.zeros((rows - have,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=0)


def pad_vocabulary(weights: Dict[str, torch.Tensor], rows: int, vocab_size: Optional[int]
                   ) -> Dict[str, torch.Tensor]:
    """`weights` with each VOCABULARY tensor resized to `rows` (resize_vocab) and, for tied
    embeddings, the last stage's copy `TIED_HEAD` set to the word embeddings."""
    out = dict(weights)
    for name in VOCABULARY:
        if name in out:
            out[name] = resize_vocab(out[name], rows, vocab_size, name)
    if OUTPUT_LAYER not in out:
        out[TIED_HEAD] = out[WORD_EMBEDDINGS]
    return out


# ---------------------------------------------------------------------------- whole checkpoints

def merge_ranks(args: argparse.Namespace, per_rank: Dict[Tuple[int, ...], Dict[str, torch.Tensor]],
                tp: int, pp: int, what: str, only: Optional[set] = None, ep: int = 1
                ) -> Dict[str, torch.Tensor]:
    """Full tensors from per-rank flat dicts keyed (tp_rank, pp_rank[, ep_rank]) (of the names in
    `only`, when given): dense tensors from the expert-parallel rank 0 files, an expert weight
    from every (ep_rank, tp_rank) file (the expert tensor rank is the file's tensor rank); the
    last stage's tied copy must equal stage 0's."""
    placement = Layout.of_args(args, pp)
    progress = Progress(f"reading {what}")
    files = {key + (0,) * (3 - len(key)): rank_dict for key, rank_dict in per_rank.items()}
    merged: Dict[str, torch.Tensor] = {}
    # the stage whose file holds each name: contiguous stages, or an interleaved run's chunks
    holder = {name: stage for (tp_rank, stage, ep_rank), rank_dict in files.items()
              if tp_rank == 0 and ep_rank == 0 for name in rank_dict}

    def shard(name: str, tp_rank: int, stage: int, ep_rank: int) -> torch.Tensor:
        rank_dict = files[(tp_rank, stage, ep_rank)]
        if name not in rank_dict:
            raise CheckpointError(f"{what}: rank (tp {tp_rank}, pp {stage}, ep {ep_rank}) has "
                                  f"no {name!r}")
        return rank_dict[name]
    for name in placement.names():
        if only is not None and name not in only:
            continue
        stage = holder.get(name, placement.stage_of(name))
        if placement.is_expert(name):
            merged[name] = placement.merge_experts(name, [
                [shard(name, t, stage, e) for t in range(tp)] for e in range(ep)])
        else:
            merged[name] = placement.merge(name, [shard(name, t, stage, 0) for t in range(tp)])
        progress.add(merged[name])
    known = set(placement.names())
    for (tp_rank, stage, ep_rank), rank_dict in files.items():
        unknown = sorted(set(rank_dict) - known)
        if unknown:
            raise CheckpointError(f"{what}: rank (tp {tp_rank}, pp {stage}, ep {ep_rank}) holds "
                                  f"{unknown[0]!r}, which the GPT-2 layout cannot map")
    tied = merged.pop(TIED_HEAD, None)
    if tied is not None and not torch.equal(tied, merged[WORD_EMBEDDINGS]):
        logger.warning("the last stage's tied word embeddings differ from the first stage's; "
                       "using the first stage's")
    progress.report(final=True)
    return merged


def target_padded_vocab(args: argparse.Namespace, rows: int, tp: int) -> int:
    """Padded vocabulary rows for tensor-parallel size `tp` (Megatron's rule when the tokenizer
    size is known; else the current rows, which must divide by `tp`)."""
    vocab = getattr(args, "vocab_size", None)
    if vocab:
        multiple = int(getattr(args, "make_vocab_size_divisible_by", 128) or 128)
        return pad_vocab_size(int(vocab), multiple, tp)
    if rows % tp:
        raise LayoutError(f"the checkpoint records no tokenizer vocab_size and its {rows} "
                          f"vocabulary rows do not divide by the target TP size {tp}")
    return rows


def target_args(source: ModelCheckpoint, tp: int, pp: int, dtype: torch.dtype,
                padded_vocab: int, iteration: Iteration, ep: int = 1,
                etp: Optional[int] = None) -> argparse.Namespace:
    """The source's args with the target layout (expert parallel sizes: `ep`, `etp` default
    `tp`), padded vocabulary, dtype and iteration, and every model option it lacks under
    Megatron's name (an import's args name only the options its family has; Megatron Core reads
    the rest). Megatron-LM's own args get the RoPE scaling factor their model computed with
    (model_args.ROPE_FACTOR_APPLIED)."""
    args = copy.copy(source.args)
    record = converted_writer_record(source.args)
    if record is not None:  # the fields added below would hide an earlier release's marks
        args.writer = record
    factor_applied = getattr(args, ROPE_FACTOR_APPLIED, False)
    for name, value in model_option_args(model_config_from_args(args, for_inference=True)
                                         ).items():
        if not hasattr(args, name) or (name == "rope_scaling_factor" and not factor_applied):
            setattr(args, name, value)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, etp or tp
    while (tp * dp) % (ep * (etp or tp)):  # the world holds whole expert grids
        dp += 1
    args.data_parallel_size, args.world_size = dp, tp * pp * dp
    args.padded_vocab_size = padded_vocab
    args.params_dtype = dtype
    args.fp16, args.bf16 = dtype == torch.float16, dtype == torch.bfloat16
    args.iteration = 0 if iteration == "release" else int(iteration)
    return args
