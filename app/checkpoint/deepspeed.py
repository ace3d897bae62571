"""DeepSpeed's checkpoint format, read without DeepSpeed's engine: its files read safely, one
model-parallel rank's whole tensors (the one read that the training engine's weights-only load
and the converter share), and the whole model.

DeepSpeed writes the files itself (app.training.engines.deepspeed saves through its engine);
their names are app.checkpoint.names'. The layout under `{load}/{tag}/` (tag `iter_0000100`,
named by the `latest` file):

    mp_rank_{mp:02d}_model_states.pt                       module (working-precision weights),
                                                           param_shapes, our client state (args,
                                                           iteration, rng_state, ...), lr_scheduler
    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   ZeRO-1/2: this DP rank's slice of
                                                           the flat fp32 master weights of each
                                                           param group and of Adam's state for it
    layer_{l}_expert_{g}_mp_rank_{mp:02d}_model_states.pt  Mixture of Experts: global expert g of
                                                           the l-th MoE layer (module order),
                                                           written by DeepSpeed's MoE
                                                           checkpointing; not in mp_rank_*

Files are numbered by model-parallel rank mp = pp_rank x TP + tp_rank (TP from the saved args).
In an expert file the weights are named as DeepSpeed's MoE layer names them (`expert_view_name`:
`{layer}.mlp.deepspeed_moe.experts.deepspeed_experts.{g}.dense_h_to_4h.weight`, one 2-D tensor
per expert), read back into our 3-D `{layer}.mlp.experts.dense_h_to_4h.weight` [E, ...].
ZeRO-1/2 partitions an MoE param group (`'moe': True`) over its expert-data-parallel group, so
its `partition_count` is EDP = DP / EP: DP rank d holds the part k = d // EP of the local experts
of expert-parallel rank d % EP (DeepSpeed's expert groups at TP = PP = 1), and the whole expert
weight is the expert-parallel ranks' local experts concatenated on dimension 0.

At ZeRO-1/2 the DP slices of each group are concatenated and cut into parameters in the order
of `param_shapes` (as DeepSpeed's zero_to_fp32 does). At ZeRO-3 the module file is per
data-parallel rank too, `zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt`, with empty
weights, and every parameter is split on its own: its flattened values, padded with zeros to a
multiple of the data-parallel size N, are cut into N pieces of ceil(numel / N) elements, piece r
kept by data-parallel rank r. Rank r's optimizer file holds, under `optimizer_state_dict`:

    fp32_flat_groups               one fp32 vector per sub-group: rank r's pieces of the
                                   sub-group's parameters, one after the other
    optimizer_state_dict.state[i]  the torch optimizer's state of sub-group i, laid out like
                                   fp32_flat_groups[i] (Adam: exp_avg, exp_avg_sq, step)
    optimizer_state_dict.param_groups[i]   its hyper-parameters
    partition_count                N;  zero_stage: 3

Sub-groups cut the param groups into runs of at most `sub_group_size` elements, in order, so
parameter p starts at offset o_p = sum over the parameters before it of ceil(numel / N) in every
rank's vector, and its whole value is the concatenation over ranks of
vector_r[o_p : o_p + ceil(numel_p / N)], cut to numel_p.

Which weights a whole read returns (`read_rank`, for the engine and the converter alike): the
fp32 master weights whenever the folder holds ZeRO optimizer files we read (ZeRO-1/2/3: the
copy the optimizer steps, the most precise one, and zero_to_fp32's answer); the module file's
weights, cast to fp32, only where no such files exist (ZeRO-0, or DeepSpeed's bf16 optimizer
files, which carry no ZeRO stage). A caller that needs module precision casts: the engine's
weights-only load copies them into its bf16/fp16 parameters.

The files pickle DeepSpeed objects; they are read the safe way (`load_deepspeed_file`: SHA-256
sidecar verified, weights_only with an allow-list of DeepSpeed's classes), so a crafted file is
refused, never run.
"""
from __future__ import annotations

import argparse
import bisect
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from app.checkpoint import CheckpointError
from app.checkpoint import files as ckpt_files
from app.checkpoint import param_layout as layout
from app.checkpoint.names import (parse_deepspeed_model_file, parse_deepspeed_optim_file,
                                  parse_zero3_model_file)
from app.checkpoint.param_layout import merge_ranks
from app.checkpoint.saved_layout import SavedCheckpoint
from app.checkpoint.state import ModelCheckpoint, OptimizerState, Progress, describe
from app.utils.third_party import prepare_deepspeed_import

logger = logging.getLogger(__name__)

STATE_KINDS = ("exp_avg", "exp_avg_sq")
"""The per-element optimizer states merged (Adam's moments)."""
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d{2,})_model_states\.pt$")
_EXPERT_VIEW = re.compile(r"^(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.+)$")


EXPERT_MODULE = "deepspeed_moe"
"""The module of DeepSpeed's MoE layer that holds its experts (named in its expert files)."""


def expert_view_name(expert: int, name: str, layer_prefix: str = "") -> str:
    """DeepSpeed's MoE name of expert `expert`'s `name` (e.g. `dense_h_to_4h.weight`) under its
    EXPERT_MODULE, and with `layer_prefix` (`...layers.{i}.mlp`) in the whole model: how the
    expert files and the DeepSpeed engine's MoE marker (app.training.engines.deepspeed_moe)
    name one expert's 2-D weight."""
    suffix = f"experts.deepspeed_experts.{expert}.{name}"
    return f"{layer_prefix}.{EXPERT_MODULE}.{suffix}" if layer_prefix else suffix


def parse_expert_view(key: str) -> Optional[Tuple[str, int]]:
    """(our 3-D weight's name, expert index) of an `expert_view_name` key; None otherwise."""
    match = _EXPERT_VIEW.match(key)
    return (f"{match.group(1)}.experts.{match.group(3)}", int(match.group(2))) if match else None


# ---------------------------------------------------------------------------- safe reads

def deepspeed_safe_globals() -> List[Any]:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and containers
    (loss scalers, the ZeRO stage enum, ZeRO's fragment addresses): the allow-list for reading
    them with weights_only=True."""
    prepare_deepspeed_import()  # DeepSpeed's CPU-accelerator warning, silenced at its source
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_file(path: str, map_location: Any = "cpu") -> Any:
    """Read one DeepSpeed checkpoint file safely: its SHA-256 sidecar verified when present,
    then weights_only with `deepspeed_safe_globals`. Raises UnsafeCheckpointError for a
    file that would run code, CheckpointError for a damaged one."""
    ckpt_files.verify_checksum(path)
    return ckpt_files.safe_torch_load(path, map_location, deepspeed_safe_globals())


# ---------------------------------------------------------------------------- one model-parallel rank

@dataclass
class RankState:
    """One model-parallel rank's whole tensors, merged from its data-parallel partitions."""

    weights: Dict[str, torch.Tensor]
    """fp32 weights by parameter name, full shape (the module docstring says which copy)."""
    moments: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)
    """STATE_KINDS -> name -> full-shape fp32 state (when asked for)."""
    steps: Dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> the optimizer's step count of the parameter's (sub-)group."""
    hparams: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """name -> hyper-parameters of its param group (lr, betas, weight_decay, ...)."""
    client: Dict[str, Any] = field(default_factory=dict)
    """The module file's dict: our client state (args, iteration, rng_state, ...)."""


def partition_numel(numel: int, data_parallel_size: int) -> int:
    """Elements of one data-parallel rank's ZeRO-3 piece of a parameter of `numel` elements."""
    return math.ceil(numel / data_parallel_size)


def read_rank(directory: str, mp_rank: int, include_optimizer: bool = False) -> RankState:
    """The whole fp32 weights (master weights where ZeRO files hold them; module docstring) of
    model-parallel rank `mp_rank` in the DeepSpeed checkpoint folder `directory`, with its
    client state and, with `include_optimizer`, Adam's moments, steps and group settings; any
    ZeRO stage and data-parallel size. CheckpointError naming the folder otherwise."""
    model_path = _model_file(directory, mp_rank)
    client = load_deepspeed_file(model_path)
    optim = _optim_files(directory, mp_rank)
    parts = [load_deepspeed_file(p)["optimizer_state_dict"] for p in optim]
    stage = int(parts[0].get("zero_stage", 0)) if parts else 0
    if stage == 0:
        if include_optimizer:
            raise CheckpointError(f"--include-optimizer: {directory} has no ZeRO optimizer files "
                                  f"for model-parallel rank {mp_rank}")
        logger.warning("%s has no ZeRO optimizer files of model-parallel rank %d; using the "
                       "module weights it saved", directory, mp_rank)
        weights = {k: v.float() for k, v in client["module"].items()}
        weights.update(_expert_files(directory, mp_rank))
        state = RankState(weights=weights)
    elif stage == 3:
        state = merge_zero3(client["param_shapes"], parts, directory, include_optimizer)
    elif stage in (1, 2):
        state = _merge_zero12(client["param_shapes"], parts, directory, include_optimizer)
    else:
        raise CheckpointError(f"{directory}: ZeRO stage {stage} is not supported (ZeRO-1/2/3)")
    state.client = client
    return state


def _model_file(directory: str, mp_rank: int) -> str:
    """The module file of `mp_rank` (ZeRO-3: data-parallel rank 0's)."""
    for name in sorted(os.listdir(directory)):
        if (parse_deepspeed_model_file(name) == mp_rank
                and parse_zero3_model_file(name) in (None, (0, mp_rank))):
            return os.path.join(directory, name)
    raise CheckpointError(f"{directory} holds no DeepSpeed module file of model-parallel rank "
                          f"{mp_rank} (*mp_rank_{mp_rank:02d}_model_states.pt)")


def _optim_files(directory: str, mp_rank: int) -> List[str]:
    """This model-parallel rank's ZeRO files, ordered by data-parallel rank."""
    found = []
    for name in os.listdir(directory):
        parsed = parse_deepspeed_optim_file(name)
        if parsed is not None and parsed[1] == mp_rank:
            found.append((parsed[0], os.path.join(directory, name)))
    return [path for _, path in sorted(found)]


def _merge_zero12(shapes: List[Dict[str, Any]], parts: List[Dict[str, Any]], directory: str,
                  include_optimizer: bool) -> RankState:
    """Whole fp32 weights (and Adam moments) of one model-parallel rank from its ZeRO-1/2
    partitions (each file's `optimizer_state_dict`, in data-parallel rank order); an MoE
    group's partitions per expert-parallel rank (module docstring)."""
    progress = Progress(f"reading ZeRO partitions of {directory}")
    counts = parts[0]["partition_count"]
    counts = list(counts) if isinstance(counts, list) else [int(counts)] * len(shapes)
    dp = max(counts)
    if dp != len(parts) or any(dp % c for c in counts):
        raise CheckpointError(f"{directory}: the ZeRO files say {counts} data-parallel ranks per "
                              f"param group but {len(parts)} *_optim_states.pt files exist for "
                              "this TP rank")
    state = RankState(weights={}, moments={kind: {} for kind in STATE_KINDS})
    paddings = parts[0].get("param_alignment_paddings")
    for g, group_shapes in enumerate(shapes):
        pads = paddings[g] if paddings else [0] * len(group_shapes)
        lanes = dp // counts[g]  # expert-parallel ranks of an MoE group; 1 for a dense one
        merged = [_merge_group(g, parts[lane::lanes], group_shapes, pads, directory,
                               include_optimizer) for lane in range(lanes)]
        for which, into in [("weights", state.weights)] + [
                (kind, state.moments[kind]) for kind in STATE_KINDS if include_optimizer]:
            for name in group_shapes:  # an MoE weight: the lanes' local experts, in order
                pieces = [lane[which][name] for lane in merged]
                into[name] = torch.cat(pieces) if lanes > 1 else pieces[0]
        if include_optimizer:
            state.steps.update(merged[0]["steps"])
            state.hparams.update(merged[0]["hparams"])
    for t in state.weights.values():
        progress.add(t)
    progress.report(final=True)
    return state


def _merge_group(g: int, members: List[Dict[str, Any]], group_shapes: Dict[str, Any],
                 pads: List[int], directory: str, include_optimizer: bool) -> Dict[str, Any]:
    """Param group g's tensors from the partitions of the ranks that split it (`members`, in
    their group's rank order): {"weights": ..., each STATE_KINDS: ..., "steps", "hparams"}."""
    out: Dict[str, Any] = {"steps": {}, "hparams": {}}
    lean = [m["single_partition_of_fp32_groups"][g] for m in members]  # saved without padding
    out["weights"] = _unflatten(torch.cat(lean), group_shapes, pads, len(members), directory)
    if not include_optimizer:
        return out
    base = [m["base_optimizer_state"] for m in members]
    group_state = [b["state"][g] if "state" in b else b[g] for b in base]
    for kind in STATE_KINDS:  # each piece laid out like (and cut to) its weights partition
        pieces = [s[kind].reshape(-1)[:w.numel()] for s, w in zip(group_state, lean)]
        out[kind] = _unflatten(torch.cat(pieces), group_shapes, pads, len(members), directory)
    step = group_state[0]["step"]
    group = base[0]["param_groups"][g] if "param_groups" in base[0] else None
    for n in group_shapes:
        out["steps"][n] = (step.clone() if isinstance(step, torch.Tensor)
                           else torch.tensor(float(step)))
        if group is not None:
            out["hparams"][n] = {k: v for k, v in group.items() if k != "params"}
    return out


def _unflatten(flat: torch.Tensor, group_shapes: Dict[str, Any], paddings: List[int], dp: int,
               directory: str) -> Dict[str, torch.Tensor]:
    """Cut a group's flat vector into its parameters (DeepSpeed pads the group to 2*DP)."""
    out, offset = {}, 0
    for (name, shape), pad in zip(group_shapes.items(), paddings):
        numel = math.prod(shape)
        out[name] = flat.narrow(0, offset, numel).view(tuple(shape)).clone()
        offset += numel + pad
    align = 2 * dp
    if math.ceil(offset / align) * align != math.ceil(flat.numel() / align) * align:
        raise CheckpointError(f"{directory}: the ZeRO partitions hold {flat.numel()} values but the "
                              f"parameter shapes need {offset}; the checkpoint is inconsistent")
    return out


def _expert_files(directory: str, mp_rank: int) -> Dict[str, torch.Tensor]:
    """The fp32 expert weights of model-parallel rank `mp_rank` from DeepSpeed's per-expert
    files (empty without any): our 3-D names, experts stacked in global order."""
    found: Dict[str, Dict[int, torch.Tensor]] = {}
    for name in sorted(os.listdir(directory)):
        match = _EXPERT_FILE.match(name)
        if match is None or int(match.group(3)) != mp_rank:
            continue
        for key, tensor in load_deepspeed_file(os.path.join(directory, name)).items():
            parsed = parse_expert_view(key)
            if parsed is None:
                raise CheckpointError(f"{os.path.join(directory, name)}: {key} is not named as "
                                      "DeepSpeed names an MoE expert's weight")
            found.setdefault(parsed[0], {})[parsed[1]] = tensor.float()
    out = {}
    for name, experts in found.items():
        if sorted(experts) != list(range(len(experts))):
            raise CheckpointError(f"{directory}: the expert files of {name} hold experts "
                                  f"{sorted(experts)}; some layer_*_expert_* file is missing")
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def merge_zero3(param_shapes: List[Dict[str, Any]], optim_states: List[Dict[str, Any]],
                where: str, include_optimizer: bool = False) -> RankState:
    """Whole tensors of one model-parallel rank from its ZeRO-3 `optim_states` (each file's
    `optimizer_state_dict`, in data-parallel rank order) and the module file's `param_shapes`
    (module docstring); CheckpointError naming `where` when the files do not fit together."""
    count = len(optim_states)
    for r, part in enumerate(optim_states):
        if int(part.get("zero_stage", 0)) != 3 or int(part.get("partition_count", -1)) != count:
            raise CheckpointError(
                f"{where}: data-parallel rank {r}'s optimizer file is not one of {count} ZeRO-3 "
                f"partitions (zero_stage {part.get('zero_stage')}, partition_count "
                f"{part.get('partition_count')}); the checkpoint is incomplete or mixed")
    shapes = {name: tuple(shape) for group in param_shapes for name, shape in group.items()}
    flats = [_rank_vector(part["fp32_flat_groups"]) for part in optim_states]
    sub_sizes = [t.numel() for t in optim_states[0]["fp32_flat_groups"]]
    needed = sum(partition_numel(math.prod(s), count) for s in shapes.values())
    if any(f.numel() != needed for f in flats):
        raise CheckpointError(f"{where}: the ZeRO-3 partitions hold {[f.numel() for f in flats]} "
                              f"values per rank but the parameter shapes need {needed}; the "
                              "checkpoint is inconsistent")
    merged = RankState(weights=_cut(flats, shapes, count))
    if include_optimizer:
        base = [part["optimizer_state_dict"] for part in optim_states]
        for kind in STATE_KINDS:
            vectors = [_rank_vector([b["state"][i][kind] for i in range(len(sub_sizes))])
                       for b in base]
            merged.moments[kind] = _cut(vectors, shapes, count)
        starts = [0]
        for size in sub_sizes:
            starts.append(starts[-1] + size)
        offset = 0
        for name, shape in shapes.items():  # each parameter's sub-group: where its piece starts
            sub = bisect.bisect_right(starts, offset) - 1
            step = base[0]["state"][sub]["step"]
            merged.steps[name] = (step.clone() if isinstance(step, torch.Tensor)
                                  else torch.tensor(float(step)))
            merged.hparams[name] = {k: v for k, v in base[0]["param_groups"][sub].items()
                                    if k != "params"}
            offset += partition_numel(math.prod(shape), count)
    return merged


def _rank_vector(pieces: List[torch.Tensor]) -> torch.Tensor:
    """One rank's sub-group vectors as one fp32 vector."""
    return torch.cat([p.reshape(-1).float() for p in pieces])


def _cut(vectors: List[torch.Tensor], shapes: Dict[str, tuple],
         count: int) -> Dict[str, torch.Tensor]:
    """Every parameter's whole value from the ranks' ZeRO-3 vectors (module docstring)."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        piece = partition_numel(numel, count)
        whole = torch.cat([v.narrow(0, offset, piece) for v in vectors])  # [count x piece]
        out[name] = whole[:numel].view(shape).clone()
        offset += piece
    return out


# ---------------------------------------------------------------------------- the whole model

def describe_deepspeed(saved: SavedCheckpoint) -> List[str]:
    """Lines describing every .pt file of a DeepSpeed checkpoint: keys, shapes, dtypes."""
    directory = saved.folder
    lines: List[str] = []
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".pt")):
        lines.append(f"{os.path.relpath(os.path.join(directory, name), saved.load)}:")
        lines += describe(load_deepspeed_file(os.path.join(directory, name)), 1)
    return lines


def read_deepspeed(saved: SavedCheckpoint, include_optimizer: bool = False) -> ModelCheckpoint:
    """The whole model of a DeepSpeed checkpoint of ours (`read_rank`'s weights of every
    model-parallel rank, merged over TP and PP), any ZeRO stage, DP, TP and PP size; `saved`
    is what app.checkpoint.saved_layout.detect found."""
    directory = saved.folder
    mp_ranks = sorted({mp for name in os.listdir(directory)
                       for mp in [parse_deepspeed_model_file(name)] if mp is not None})
    if not mp_ranks:
        raise CheckpointError(f"{directory} has no mp_rank_XX_model_states.pt: not a DeepSpeed "
                              "checkpoint")
    ranks = [read_rank(directory, mp_rank, include_optimizer) for mp_rank in mp_ranks]
    args = ranks[0].client.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{_model_file(directory, mp_ranks[0])} has no 'args' (not written "
                              "by pretrain_gpt2.py --deepspeed?): its model shape is unknown")
    mp = len(mp_ranks)  # DeepSpeed numbers files by model-parallel rank pp_rank x TP + tp_rank
    tp = int(getattr(args, "tensor_model_parallel_size", mp) or mp)
    pp = mp // tp
    by_rank = {(mp_rank % tp, mp_rank // tp): state for mp_rank, state in zip(mp_ranks, ranks)}
    first = ranks[0].client
    result = ModelCheckpoint(args=argparse.Namespace(**vars(args)),
                             weights=merge_ranks(args, {k: s.weights for k, s in by_rank.items()},
                                                 tp, pp, "weights"),
                             iteration=int(first.get("iteration", 0)), source_layout=(tp, pp))
    rng = first.get("rng_state")
    if rng is not None:
        result.rng_states = {(0, 0): [rng] if isinstance(rng, dict) else rng}
    if include_optimizer:
        result.optimizer = _whole_optimizer(args, by_rank, tp, pp)
        result.lr_scheduler = first.get("lr_scheduler")
    return result


def _whole_optimizer(args: argparse.Namespace, by_rank: Dict[Tuple[int, int], RankState],
                     tp: int, pp: int) -> OptimizerState:
    """Adam's moments merged over TP and PP, each parameter's step, and the hyper-parameters
    of the model's own optimizer groups (layout.Layout.group_of names a parameter's group)."""
    merged = {kind: merge_ranks(args, {k: s.moments[kind] for k, s in by_rank.items()}, tp, pp,
                                f"optimizer {kind}") for kind in STATE_KINDS}
    steps = {n: t for s in by_rank.values() for n, t in s.steps.items()}
    group_of: Callable[[str], str] = layout.Layout.of_args(args, pp).group_of
    hparams = {group_of(n): group for s in by_rank.values() for n, group in s.hparams.items()}
    return OptimizerState(
        per_param={n: {"exp_avg": merged["exp_avg"][n], "exp_avg_sq": merged["exp_avg_sq"][n],
                       "step": steps[n]} for n in merged["exp_avg"]},
        group_hparams=hparams)
