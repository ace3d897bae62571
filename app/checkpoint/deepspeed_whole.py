"""Read a DeepSpeed checkpoint written by pretrain_gpt2.py --deepspeed (ZeRO-0/1/2/3, any DP and TP)
into a ModelCheckpoint: the consolidated fp32 master weights and, when asked, Adam's moments.

DeepSpeed's layout under `{load}/{tag}/` (tag `iter_0000100`, named by the `latest` file):

    mp_rank_{mp:02d}_model_states.pt                       module (working-precision weights),
                                                           param_shapes, our client state (args,
                                                           iteration, rng_state, ...), lr_scheduler
    [bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt   this DP rank's slice of the flat
                                                           fp32 master weights of each param group
                                                           and of Adam's state for that slice

At ZeRO-3 the module file is per data-parallel rank too, `zero_pp_rank_{dp}_mp_rank_{mp:02d}_
model_states.pt` (its weights empty: they live only in the optimizer files' fp32 pieces), and
the optimizer files hold each parameter split on its own (app.checkpoint.zero3 merges them).
Files are numbered by model-parallel rank mp = pp_rank x TP + tp_rank (the pipeline stages of a
PP > 1 run; TP from the saved args). For each of them the DP slices of each group are concatenated and cut into parameters in the
order of `param_shapes` (DeepSpeed's zero_to_fp32 does the same for a single TP rank); then
the TP shards are merged by app.checkpoint.layout. The files pickle DeepSpeed objects; they are read
the safe way (app.checkpoint.deepspeed_files.load_deepspeed_file: SHA-256 sidecar verified,
weights_only with an allow-list of DeepSpeed's classes), so a crafted file is refused, never run.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from app.checkpoint import layout
from app.checkpoint.state import ModelCheckpoint, OptimizerState, Progress, describe
from app.checkpoint import megatron as ckpt
from app.checkpoint.deepspeed_files import load_deepspeed_file
from app.checkpoint.megatron_whole import merge_ranks
from app.checkpoint.names import (parse_deepspeed_model_file, parse_deepspeed_optim_file,
                                  parse_zero3_model_file, resolve_iteration)
from app.checkpoint.zero3 import merge_zero3

logger = logging.getLogger(__name__)


def describe_deepspeed(load_dir: str, iteration: Optional[Any] = None) -> List[str]:
    """Lines describing every .pt file of a DeepSpeed checkpoint: keys, shapes, dtypes."""
    directory, _ = resolve_iteration(load_dir, iteration)
    lines: List[str] = []
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".pt")):
        lines.append(f"{os.path.relpath(os.path.join(directory, name), load_dir)}:")
        lines += describe(load_file(os.path.join(directory, name)), 1)
    return lines


def load_file(path: str) -> Dict[str, Any]:
    """One DeepSpeed file, read safely (checksum, weights_only with DeepSpeed's allow-list);
    CheckpointError naming the file when it is damaged or would run code."""
    return load_deepspeed_file(path)


def read_deepspeed(load_dir: str, iteration: Optional[Any] = None,
                   include_optimizer: bool = False) -> ModelCheckpoint:
    """The whole model of a DeepSpeed checkpoint of ours (fp32 masters), any DP and TP size."""
    directory, _ = resolve_iteration(load_dir, iteration)
    model_files = sorted((mp_rank, name) for name in os.listdir(directory)
                         for mp_rank in [parse_deepspeed_model_file(name)]
                         if mp_rank is not None and parse_zero3_model_file(name) in (None, (0, mp_rank)))
    if not model_files:
        raise ckpt.CheckpointError(f"{directory} has no mp_rank_XX_model_states.pt: not a DeepSpeed "
                                   "checkpoint")
    mp = len(model_files)  # DeepSpeed numbers files by model-parallel rank pp_rank x TP + tp_rank
    first: Dict[str, Any] = load_file(os.path.join(directory, model_files[0][1]))
    tp = int(getattr(first.get("args"), "tensor_model_parallel_size", mp) or mp)
    pp = mp // tp
    weights_per_rank: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = {}
    moments_per_rank: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {
        "exp_avg": {}, "exp_avg_sq": {}}
    steps: Dict[str, torch.Tensor] = {}
    hparams: Dict[str, Dict[str, Any]] = {}
    group_of = _group_namer(first.get("args"), pp)
    for mp_rank, name in model_files:
        states = first if mp_rank == 0 else load_file(os.path.join(directory, name))
        tp_rank, pp_rank = mp_rank % tp, mp_rank // tp
        optim = _optim_files(directory, mp_rank)
        if optim:
            weights, moments, step, groups = _consolidate(states, optim, directory, include_optimizer,
                                                          group_of)
            hparams.update(groups)
            steps.update(step)
        elif include_optimizer:
            raise ckpt.CheckpointError(f"--include-optimizer: {directory} has no ZeRO optimizer files "
                                       f"for model-parallel rank {mp_rank}")
        else:
            logger.warning("%s has no ZeRO optimizer files; using the module weights it saved", directory)
            weights, moments = {k: v.float() for k, v in states["module"].items()}, {}
        weights_per_rank[(tp_rank, pp_rank)] = weights
        for kind, values in moments.items():
            moments_per_rank[kind][(tp_rank, pp_rank)] = values
    args = first.get("args")
    if not isinstance(args, argparse.Namespace):
        first_file = os.path.join(directory, model_files[0][1])
        raise ckpt.CheckpointError(f"{first_file} has no 'args' (not written by pretrain_gpt2.py "
                                   "--deepspeed?): its model shape is unknown")
    result = ModelCheckpoint(args=argparse.Namespace(**vars(args)),
                             weights=merge_ranks(args, weights_per_rank, tp, pp, "weights"),
                             iteration=int(first.get("iteration", 0)), source_layout=(tp, pp))
    rng = first.get("rng_state")
    if rng is not None:
        result.rng_states = {(0, 0): [rng] if isinstance(rng, dict) else rng}
    if include_optimizer:
        merged = {kind: merge_ranks(args, ranks, tp, pp, f"optimizer {kind}")
                  for kind, ranks in moments_per_rank.items()}
        result.optimizer = OptimizerState(
            per_param={n: {"exp_avg": merged["exp_avg"][n], "exp_avg_sq": merged["exp_avg_sq"][n],
                           "step": steps[n]} for n in merged["exp_avg"]},
            group_hparams=hparams)
        result.lr_scheduler = first.get("lr_scheduler")
    return result


def _optim_files(directory: str, mp_rank: int) -> List[str]:
    """This model-parallel rank's ZeRO files, ordered by data-parallel rank."""
    found = []
    for name in os.listdir(directory):
        parsed = parse_deepspeed_optim_file(name)
        if parsed is not None and parsed[1] == mp_rank:
            found.append((parsed[0], os.path.join(directory, name)))
    return [path for _, path in sorted(found)]


def _group_namer(args: Any, pp: int) -> Callable[[str], str]:
    """name -> the model's own optimizer group holding it (layout.Layout.group_of), the model
    built from `args` on first use."""
    built: List[layout.Layout] = []

    def group_of(name: str) -> str:
        if not built:
            built.append(layout.Layout.of_args(args, pp))
        return built[0].group_of(name)
    return group_of


def _consolidate(model_states: Dict[str, Any], optim_paths: List[str], directory: str,
                 include_optimizer: bool, group_of: Callable[[str], str]):
    """Full fp32 weights (and Adam moments) of one TP rank from its DP-partitioned ZeRO files;
    `group_of` names a parameter's optimizer group."""
    progress = Progress(f"reading ZeRO partitions of {os.path.basename(optim_paths[0])}")
    parts = [load_file(p)["optimizer_state_dict"] for p in optim_paths]
    stage = int(parts[0].get("zero_stage", 0))
    if stage == 3:
        return _consolidate_zero3(model_states, parts, directory, include_optimizer, progress,
                                  group_of)
    if stage not in (1, 2):
        raise ckpt.CheckpointError(f"{directory}: ZeRO stage {stage} is not supported (ZeRO-1/2/3)")
    dp = parts[0]["partition_count"]
    dp = max(dp) if isinstance(dp, list) else int(dp)
    if dp != len(parts):
        raise ckpt.CheckpointError(f"{directory}: the ZeRO files say {dp} data-parallel ranks but "
                                   f"{len(parts)} *_optim_states.pt files exist for this TP rank")
    shapes = model_states["param_shapes"]
    weights: Dict[str, torch.Tensor] = {}
    moments: Dict[str, Dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    steps: Dict[str, torch.Tensor] = {}
    hparams: Dict[str, Dict[str, Any]] = {}
    paddings = parts[0].get("param_alignment_paddings")
    for g, group_shapes in enumerate(shapes):
        flat = torch.cat([p["single_partition_of_fp32_groups"][g] for p in parts])
        pads = paddings[g] if paddings else [0] * len(group_shapes)
        weights.update(_unflatten(flat, group_shapes, pads, dp, directory))
        if include_optimizer:
            base = [p["base_optimizer_state"] for p in parts]
            group_state = [b["state"][g] if "state" in b else b[g] for b in base]
            group_pads = parts[0].get("group_paddings") or [0] * len(shapes)
            for kind in moments:
                pieces = [s[kind] for s in group_state]
                if group_pads[g]:  # the last DP rank's slice carries the group's padding
                    pieces[-1] = pieces[-1][:pieces[-1].numel() - group_pads[g]]
                moments[kind].update(_unflatten(torch.cat(pieces), group_shapes, pads, dp, directory))
            step = group_state[0]["step"]
            for n in group_shapes:
                steps[n] = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
            if "param_groups" in base[0]:
                group = base[0]["param_groups"][g]
                names = list(group_shapes)
                group_name = group_of(names[0])
                hparams[group_name] = {k: v for k, v in group.items() if k != "params"}
    for t in weights.values():
        progress.add(t)
    progress.report(final=True)
    return weights, moments, steps, hparams


def _consolidate_zero3(model_states: Dict[str, Any], parts: List[Dict[str, Any]], directory: str,
                       include_optimizer: bool, progress: Progress,
                       group_of: Callable[[str], str]):
    """`_consolidate` for ZeRO-3 files (app.checkpoint.zero3): weights, moments, steps, and
    the hyper-parameters of the 'decay' and 'no_decay' groups."""
    merged = merge_zero3(model_states["param_shapes"], parts, directory, include_optimizer)
    hparams = {group_of(name): group
               for name, group in merged.hparams.items()}
    for t in merged.weights.values():
        progress.add(t)
    progress.report(final=True)
    return merged.weights, merged.moments, merged.steps, hparams


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
        raise ckpt.CheckpointError(f"{directory}: the ZeRO partitions hold {flat.numel()} values but the "
                                   f"parameter shapes need {offset}; the checkpoint is inconsistent")
    return out
