"""Megatron-LM's `--ckpt-format torch_dist` for our GPT-2: every rank writes its own shards, and
a checkpoint saved at one TP x PP x DP loads at any other.

The directory of an iteration is Megatron Core's (app.checkpoint.dcp_files has the files):
the model tensors under Megatron Core's keys and global shapes (app.checkpoint.mcore_names,
layers stacked), the optimizer states beside them in model space (`optimizer.state.<state>.<key>`,
app.optim.model_space), and as ShardedObjects the common state (`common_state`: args,
iteration, checkpoint_version, opt_param_scheduler, the optimizer's non-tensor part,
content_metadata; also written as `common.pt`, the only place Megatron Core 0.16-0.18 read it
from, while 0.19 and later read either), each (pipeline, tensor) rank's RNG states
(`rng_state`, a (PP, TP) grid) and the layers' empty `_extra_state`s. The tracker and iteration directory names are the legacy
format's (app.checkpoint.names).

Saving (`save_entries`, `start_save`): each rank turns its local tensors into boxes of the
global tensors (app.checkpoint.sharding), keeps those it must write (replicas are spread over
the data-parallel and, for replicated parameters, tensor-parallel ranks; the distributed
optimizer's shards are each written by their owner) and writes them in its own file, no rank
gathering another's tensors; then rank 0 gathers the small per-rank records and writes the
global metadata. The commit is app.checkpoint.commit's (crash-safe, one tracker, undo on any
failure), with the write step optionally in the background (--async-save).

Loading (`read_rank_state`): each rank reads exactly the boxes of its own local tensors and
optimizer pieces, whatever layout wrote them (torch's resharding read); a stored tensor of
another global shape is refused with the key and both shapes.

The whole model in one process (`read_torch_dist`, `write_torch_dist`: the converter's): the
files already hold global tensors under Megatron Core's keys, so reading is one full read per
key (the stacked layer tensors cut back into our per-layer names, app.checkpoint.mcore_names)
and writing is one box per tensor from a single rank: its TP x PP is irrelevant, training
reshards it on load. Mixed-precision checkpoints give their fp32 main weights
(`optimizer.state.fp32_param` / `.param`), as the legacy reader does. Checkpoints written by
Megatron-LM itself are read the same way (its args may hold Megatron classes, read as inert
stand-ins).
"""
from __future__ import annotations

import copy
import io
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from app.checkpoint import (CheckpointError, commit, dcp_files, layout, mcore_names, mcore_state,
                            sharding)
from app.checkpoint.dcp_files import Entry, RankFiles
from app.checkpoint.files import sha256_file
from app.checkpoint.layout import target_args
from app.checkpoint.names import Iteration, checkpoint_dir, resolve_iteration_number, write_tracker
from app.checkpoint.state import (ModelCheckpoint, OptimizerState, Progress, cast_weights,
                                  describe)
from app.optim.mixed_precision import check_saved_groups
from app.optim.model_space import MAIN, MOMENTS, MOMENTUM, ModelSpaceState, ParamState
from app.utils.dtypes import torch_dtype
from app.utils.fileio import atomic_write_bytes

logger = logging.getLogger(__name__)

FORMAT = "torch_dist"
COMMON_KEY = mcore_names.object_key("common_state", (0,), (1,))
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Tensors whose rows are the padded vocabulary: Megatron Core loads them with
allow_shape_mismatch, so their padding may differ between the saving and the loading run."""


@dataclass(frozen=True)
class RankLayout:
    """This rank's place in the TP x PP x DP layout and the model's depth (dp: the replicas of
    the weights, data x context ranks with context parallelism: ParallelState.gradient_state)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    rank: int
    num_layers: int

    @classmethod
    def of(cls, parallel_state: Any, num_layers: int) -> "RankLayout":
        ps = parallel_state
        return cls(ps.tensor_model_parallel_rank, ps.tensor_model_parallel_size,
                   ps.pipeline_model_parallel_rank, ps.pipeline_model_parallel_size,
                   ps.data_parallel_rank, ps.data_parallel_size, ps.rank, num_layers)


def rng_key(layout: RankLayout) -> str:
    """The DCP key of this (pipeline, tensor) rank's RNG states: `rng_state/shard_pp.tp_PP.TP`."""
    return mcore_names.object_key("rng_state", (layout.pp_rank, layout.tp_rank),
                                  (layout.pp_size, layout.tp_size))


def placement(name: str, tensor: torch.Tensor, layout: RankLayout) -> sharding.Placement:
    """Where this rank's local `tensor` of parameter `name` lies in Megatron Core's global
    tensor (the TP split read from the parameter's own marks)."""
    key, layer = mcore_names.to_mcore(name)
    return sharding.place(key, tensor.shape, partition_dim=getattr(tensor, "partition_dim", -1),
                          tp_rank=layout.tp_rank, tp_size=layout.tp_size, layer=layer,
                          num_layers=layout.num_layers,
                          replicated_rows=getattr(tensor, "replicated_rows", None),
                          glu_halves=getattr(tensor, "glu_halves", False))


def _box(flat_or_local: torch.Tensor, region: sharding.Region, stacked: bool,
         flat_offset: Optional[int] = None) -> torch.Tensor:
    """The view of `region` in a local tensor (or, with `flat_offset`, in a flat piece), shaped
    as the global box (a leading 1 for the layer dimension)."""
    if flat_offset is not None:
        view = flat_or_local.reshape(-1)[flat_offset:flat_offset + region.numel].view(region.size)
    else:
        view = flat_or_local
        for dim, (start, size) in enumerate(zip(region.local_start, region.size)):
            view = view.narrow(dim, start, size)
    return view.unsqueeze(0) if stacked else view


# ---------------------------------------------------------------------------- saving

def optimizer_entries_of(state: ModelSpaceState, params: Dict[str, torch.Tensor],
                         layout: RankLayout) -> List[Tuple[sharding.Candidate, Entry]]:
    """Candidate boxes of the optimizer's states: each state of a parameter as
    `optimizer.state.<state>.<key>` (the main weights as `fp32_param`, or `param` for the
    distributed optimizer's pieces), placed like the parameter itself."""
    out = []
    for param_state in state.params:
        if param_state.name == mcore_names.TIED_COPY:
            continue  # the first stage's embedding states hold the same values
        local = params[param_state.name]
        where = placement(param_state.name, local, layout)
        for state_name, tensor in param_state.tensors.items():
            stored = state_name
            if state_name == MAIN:
                stored = "param" if param_state.piece is not None else "fp32_param"
            key = mcore_names.optimizer_key(stored, where.key)
            for region, offset in sharding.piece_regions(where, local.shape, param_state.piece):
                box = _box(tensor, region, where.stacked,
                           offset if param_state.piece is not None else None)
                candidate = sharding.Candidate(key, region.global_offset,
                                               box.numel() * box.element_size(), region.copies,
                                               region.copy_index, param_state.piece is None)
                out.append((candidate, Entry(key, box, where.global_shape, region.global_offset)))
    return out


def save_entries(params: Dict[str, torch.Tensor], layout: RankLayout,
                 optimizer: Optional[ModelSpaceState], common: Optional[Dict[str, Any]],
                 rng_state: Optional[Dict[str, Any]]) -> List[Entry]:
    """Everything this rank writes: its share of the model and optimizer boxes, its layers'
    `_extra_state` objects (tensor rank 0, data rank 0), its RNG states (data rank 0) and, on
    rank 0 when given, the common state."""
    found: List[Tuple[sharding.Candidate, Entry]] = []
    layers = set()
    for name, tensor in params.items():
        if name == mcore_names.TIED_COPY:
            continue  # a replica of the first stage's word embeddings
        where = placement(name, tensor, layout)
        if where.stacked:
            layers.add(where.regions[0].global_offset[0])
        for region in where.regions:
            box = _box(tensor.detach(), region, where.stacked)
            found.append((sharding.Candidate(where.key, region.global_offset,
                                             box.numel() * box.element_size(), region.copies,
                                             region.copy_index, True),
                          Entry(where.key, box, where.global_shape, region.global_offset)))
    if optimizer is not None:
        found += optimizer_entries_of(optimizer, params, layout)
    mine = sharding.assign_writers([c for c, _ in found], layout.dp_size, layout.dp_rank)
    entries = [entry for (_, entry), keep in zip(found, mine) if keep]
    if layout.tp_rank == 0 and layout.dp_rank == 0:
        empty = dcp_files.object_bytes(None)
        entries += [Entry(mcore_names.extra_state_key(module, layer, layout.num_layers),
                          data=empty)
                    for layer in sorted(layers) for module in mcore_names.EXTRA_STATE_MODULES]
    if rng_state is not None and layout.dp_rank == 0:
        entries.append(Entry(rng_key(layout), data=dcp_files.object_bytes([rng_state])))
    if common is not None and layout.rank == 0:
        entries.append(Entry(COMMON_KEY, data=dcp_files.object_bytes(common)))
    return entries


def write_common_pt(directory: str, entries: Sequence[Entry], record: RankFiles) -> None:
    """When `entries` hold the common state (rank 0's): write it also as `common.pt`, the dict
    itself as Megatron Core's save_common writes it (0.16 to 0.18 read only that; 0.19 and later
    read either), and add its SHA-256 to `record`, this rank's, for integrity.json."""
    common = next((e.data for e in entries if e.key == COMMON_KEY), None)
    if common is None:
        return
    path = os.path.join(directory, dcp_files.COMMON_PT)
    buffer = io.BytesIO()
    torch.save(dcp_files.load_object(common, path)[0], buffer)
    atomic_write_bytes(path, buffer.getvalue(), durable=True)
    record.digests[dcp_files.COMMON_PT] = sha256_file(path)


def start_save(save_dir: str, iteration: Iteration, entries: Sequence[Entry], *, rank: int,
               gather: Callable[[Optional[RankFiles]], Optional[List[Optional[RankFiles]]]],
               agree: Callable[[bool], bool], keep_last_n: Optional[int] = None,
               background: bool = False,
               capture: Optional[Callable[[], None]] = None) -> commit.PendingSave:
    """Write this rank's `entries` as its `__<rank>_0.distcp` of `iteration`, then (in
    `PendingSave.finish`) gather every rank's record to rank 0, which writes the global
    metadata, and commit (app.checkpoint.commit; rank 0 writes the tracker). Every rank
    calls this. `gather(record)` returns every rank's record on rank 0 (None elsewhere); a
    failed rank sends None, and then nothing is published and the save is undone everywhere."""
    directory = checkpoint_dir(save_dir, iteration)
    written: List[RankFiles] = []

    def write() -> Optional[Tuple[str, OSError]]:
        try:
            written.append(dcp_files.write_rank_files(directory, rank, entries,
                                                      commit.save_stage))
            write_common_pt(directory, entries, written[0])
        except OSError as exc:
            return os.path.join(directory, f"__{rank}_0.distcp"), exc
        return None

    def publish(ok: bool) -> Optional[Tuple[str, OSError]]:
        records = gather(written[0] if ok and written else None)
        if rank != 0 or records is None or any(r is None for r in records):
            return None
        try:
            dcp_files.publish(directory, [r for r in records if r is not None])
        except Exception as exc:  # noqa: BLE001 - reported through the agreement
            return directory, exc if isinstance(exc, OSError) else OSError(str(exc))
        return None

    def undo() -> None:
        names = [n for r in written for n in dcp_files.rank_file_names(r)]
        if rank == 0:
            names += [dcp_files.DCP_METADATA, dcp_files.CONFIG_FILE, dcp_files.INTEGRITY_FILE,
                      dcp_files.COMMON_PT]
        for name in names:
            commit.remove_written_file(os.path.join(directory, name), directory)

    return commit.start_save(save_dir, iteration, write=write, undo=undo, agree=agree,
                             is_tracker_writer=rank == 0, keep_last_n=keep_last_n,
                             background=background, capture=capture, publish=publish)


# ---------------------------------------------------------------------------- reading

def read_common(reader: dcp_files.Reader) -> Dict[str, Any]:
    """The common state: the `common_state` object, or an older checkpoint's common.pt."""
    where = os.path.join(reader.directory, dcp_files.COMMON_PT)
    if reader.has_object(COMMON_KEY):
        where = f"{reader.directory} ({COMMON_KEY})"
        data = reader.read([], [COMMON_KEY])[COMMON_KEY]
    elif os.path.isfile(where):
        reader.verify([dcp_files.COMMON_PT])
        with open(where, "rb") as f:
            data = f.read()
    else:
        raise CheckpointError(f"{reader.directory} holds neither {COMMON_KEY} nor "
                              f"{dcp_files.COMMON_PT}: it is not a complete torch_dist checkpoint")
    value = dcp_files.load_object(data, where)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} does not hold a dict (found {type(value).__name__})")
    return value


def _check_shape(reader: dcp_files.Reader, where: sharding.Placement, name: str) -> Tuple[int, ...]:
    """The stored global shape of `where.key`; CheckpointError when it is absent or differs
    from ours other than in padded vocabulary rows."""
    meta = reader.tensor_meta(where.key)
    if meta is None:
        raise CheckpointError(f"{reader.directory} holds no tensor {where.key} (our {name}); "
                              "was it saved from another model (--untie-embeddings-and-output-"
                              "weights, --position-embedding-type)?")
    stored = tuple(meta.size)
    ours = where.global_shape
    vocab_only = (where.key in VOCAB_KEYS and len(stored) == len(ours) and stored[1:] == ours[1:])
    if stored != ours and not vocab_only:
        raise CheckpointError(
            f"{reader.directory}: {where.key} (our {name}) is stored with global shape "
            f"{list(stored)} but this model's is {list(ours)}; the model shape differs "
            "(--num-layers, --hidden-size, --num-attention-heads, --num-query-groups, "
            "--ffn-hidden-size, --max-position-embeddings): a torch_dist checkpoint reshards "
            "over TP/PP/DP, not over the model's shape")
    return stored


def _stored_rows(reader: dcp_files.Reader, where: sharding.Placement, name: str,
                 common: Dict[str, Any]) -> int:
    """Rows of the stored tensor (after `_check_shape`); a vocabulary tensor may keep fewer
    rows than stored only when the dropped ones are padding (beyond the saved vocab_size)."""
    stored = _check_shape(reader, where, name)
    rows = stored[1 if where.stacked else 0]
    ours = where.global_shape[0]
    vocab = getattr(common.get("args"), "vocab_size", None)
    if where.key in VOCAB_KEYS and rows > ours and (vocab is None or int(vocab) > ours):
        raise CheckpointError(
            f"{reader.directory}: {where.key} holds {rows} vocabulary rows (tokenizer size "
            f"{vocab}) and this model {ours}: real tokens would be cut; use the same tokenizer "
            "and --make-vocab-size-divisible-by")
    return rows


def _boxes_for(where: sharding.Placement, local: torch.Tensor, stored_rows: int, key: str,
               piece: Optional[Tuple[int, int]], destination: torch.Tensor
               ) -> List[Tuple[str, Tuple[int, ...], torch.Tensor]]:
    """The read boxes filling `destination` (the local tensor, or its flat piece), cut to the
    stored rows of a vocabulary tensor (rows beyond stay as they are: zeros)."""
    out = []
    for region, offset in sharding.piece_regions(where, local.shape, piece):
        view = _box(destination, region, where.stacked, offset if piece is not None else None)
        row_dim = 1 if where.stacked else 0
        first = region.global_offset[row_dim]
        keep = min(view.shape[row_dim], max(0, stored_rows - first))
        if keep < view.shape[row_dim]:
            view = view.narrow(row_dim, 0, keep)
        if view.numel():
            out.append((key, region.global_offset, view))
    return out


def _stored_dtype(reader: dcp_files.Reader, key: str, default: torch.dtype) -> torch.dtype:
    meta = reader.tensor_meta(key)
    return meta.properties.dtype if meta is not None else default


@dataclass
class RankState:
    """What one rank read: its weights (the stored dtype) and fp32 main weights by parameter
    name, its optimizer state in model space (or None), the common state, its RNG states
    (None when the layout changed or none were saved) and the iteration directory."""

    weights: Dict[str, torch.Tensor]
    mains: Optional[Dict[str, torch.Tensor]]
    optimizer: Optional[ModelSpaceState]
    common: Dict[str, Any]
    rng_state: Any
    directory: str


def read_rank_state(directory: str, params: Dict[str, torch.Tensor], layout: RankLayout,
                    optimizer: Optional[ModelSpaceState], common: Optional[Dict[str, Any]] = None,
                    reader: Optional[dcp_files.Reader] = None) -> RankState:
    """Read this rank's share of the torch_dist checkpoint in `directory`.

    `params` are this rank's local tensors by name (their shapes and marks say what to read);
    `optimizer`, when given, is the template of this rank's optimizer state (its names, pieces
    and state kinds: `model_space_state()` of the optimizer to load); missing optimizer states
    raise CheckpointError. One read pass over the files each box comes from.
    """
    reader = reader or dcp_files.Reader(directory)
    common = common if common is not None else read_common(reader)
    boxes: List[Tuple[str, Tuple[int, ...], torch.Tensor]] = []
    weights: Dict[str, torch.Tensor] = {}
    mains: Dict[str, torch.Tensor] = {}
    for name, local in params.items():
        where = placement(name, local, layout)
        rows = _stored_rows(reader, where, name, common)
        dtype = _stored_dtype(reader, where.key, local.dtype)
        weights[name] = torch.zeros(local.shape, dtype=dtype)
        boxes += _boxes_for(where, local, rows, where.key, None, weights[name])
        main_key = next((mcore_names.optimizer_key(k, where.key)
                         for k in mcore_names.MAIN_WEIGHT_KEYS
                         if reader.tensor_meta(mcore_names.optimizer_key(k, where.key))), None)
        if main_key is not None:
            mains[name] = torch.zeros(local.shape, dtype=torch.float32)
            boxes += _boxes_for(where, local, rows, main_key, None, mains[name])
    state = None
    if optimizer is not None:
        state, more = _optimizer_boxes(reader, optimizer, params, layout, common)
        boxes += more
    rng_name = rng_key(layout)
    objects = [rng_name] if reader.has_object(rng_name) else []
    read = reader.read(boxes, objects)
    rng = None
    if rng_name in read:
        value = dcp_files.load_object(read[rng_name], f"{directory} ({rng_name})")
        rng = value[0] if isinstance(value, list) and len(value) == 1 else value
    return RankState(weights, mains if len(mains) == len(weights) else None, state, common,
                     rng, directory)


def _optimizer_boxes(reader: dcp_files.Reader, template: ModelSpaceState,
                     params: Dict[str, torch.Tensor], layout: RankLayout,
                     common: Dict[str, Any]) -> Tuple[ModelSpaceState, List[Any]]:
    """The model-space state to fill (tensors allocated) and the boxes filling it."""
    saved = mcore_state.optimizer_common(common, reader.directory)
    if saved.named_groups:
        try:
            check_saved_groups(saved.param_groups, template.param_groups)
        except ValueError as exc:
            raise CheckpointError(f"optimizer state in {reader.directory}: {exc}") from exc
    boxes: List[Any] = []
    out: List[ParamState] = []
    missing: List[str] = []
    for entry in template.params:
        local = params[entry.name]
        where = placement(entry.name, local, layout)
        rows = _stored_rows(reader, where, entry.name, common)
        size = local.numel() if entry.piece is None else entry.piece[1] - entry.piece[0]
        shape = tuple(local.shape) if entry.piece is None else (size,)
        tensors: Dict[str, torch.Tensor] = {}
        for state_name in entry.keys:
            key = mcore_names.optimizer_key(state_name, where.key)
            if reader.tensor_meta(key) is None:
                missing.append(key)
                continue
            tensors[state_name] = torch.zeros(shape, dtype=torch.float32)
            boxes += _boxes_for(where, local, rows, key, entry.piece, tensors[state_name])
        out.append(ParamState(entry.name, entry.piece, tensors, entry.keys))
    if missing and any(p.tensors for p in out):
        raise CheckpointError(f"{reader.directory} lacks optimizer states {missing[:3]} while "
                              "holding others: was it saved with another --optimizer? Pass "
                              "--no-load-optim to start the optimizer fresh")
    groups = saved.param_groups if saved.named_groups else template.param_groups
    return ModelSpaceState(out, groups, saved.step, saved.grad_scaler), boxes


# ---------------------------------------------------------------------------- the whole model


def _by_name(reader: dcp_files.Reader, prefix: str, num_layers: int, progress: Progress
             ) -> Dict[str, torch.Tensor]:
    """{our parameter name: full tensor} of every model key stored under `prefix` + key (the
    model itself for "", an optimizer state for `optimizer.state.<state>.`)."""
    out: Dict[str, torch.Tensor] = {}
    for key in mcore_names.model_keys():
        if reader.tensor_meta(prefix + key) is None:
            continue
        tensor = dcp_files.read_full(reader, prefix + key)
        progress.add(tensor)
        if mcore_names.is_stacked(key):
            if tensor.shape[0] != num_layers:
                raise CheckpointError(f"{reader.directory}: {prefix + key} stacks "
                                      f"{tensor.shape[0]} layers, the args say {num_layers}")
            out.update({mcore_names.from_mcore(key, i): tensor[i].clone()
                        for i in range(num_layers)})
        else:
            out[mcore_names.from_mcore(key)] = tensor
    return out


def describe_torch_dist(load_dir: str, iteration: Optional[Iteration] = None) -> List[str]:
    """Lines describing a torch_dist checkpoint: every stored key with its global shape, dtype
    and number of chunks, every object, then the common state."""
    iteration = resolve_iteration_number(load_dir, iteration)
    directory = checkpoint_dir(load_dir, iteration)
    reader = dcp_files.Reader(directory)
    lines = [f"torch_dist checkpoint {directory} ({len(reader.keys())} keys):"]
    for key in reader.keys():
        meta = reader.tensor_meta(key)
        if meta is None:
            lines.append(f"  {key}: object")
        else:
            dtype = str(meta.properties.dtype).replace("torch.", "")
            lines.append(f"  {key}: {list(meta.size)} {dtype}, {len(meta.chunks)} chunk(s)")
    lines.append("common_state:")
    return lines + describe(read_common(reader), 1)


def read_torch_dist(load_dir: str, iteration: Optional[Iteration] = None,
                    include_optimizer: bool = False) -> ModelCheckpoint:
    """The whole model (and, with `include_optimizer`, its optimizer state, LR schedule and RNG
    states) of a torch_dist checkpoint."""
    iteration = resolve_iteration_number(load_dir, iteration)
    directory = checkpoint_dir(load_dir, iteration)
    if not dcp_files.is_dcp_checkpoint(directory):
        raise CheckpointError(f"{directory} is not a torch_dist checkpoint (no metadata.json "
                              "or .metadata); use --input-format torch or deepspeed")
    reader = dcp_files.Reader(directory)
    common = read_common(reader)
    mcore_state.check_checkpoint_version(common, directory)
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{directory} has no 'args': its model shape is unknown")
    num_layers = int(args.num_layers)
    progress = Progress("reading torch_dist")
    weights = _by_name(reader, "", num_layers, progress)
    for main in mcore_names.MAIN_WEIGHT_KEYS:  # mixed precision: the exact fp32 weights
        weights.update(_by_name(reader, mcore_names.optimizer_key(main, ""), num_layers,
                                progress))
    missing = sorted(set(layout.Layout.of_args(args, 1).names()) - set(weights))
    if missing:
        raise CheckpointError(f"{directory} lacks {missing[:3]}: not a GPT-2 checkpoint")
    source_tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    source_pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    result = ModelCheckpoint(args=copy.copy(args), weights=weights, iteration=iteration,
                             source_layout=(source_tp, source_pp))
    if include_optimizer:
        result.optimizer = _read_optimizer(reader, common, num_layers, progress)
        result.lr_scheduler = mcore_state.scheduler_state(common)
        result.rng_states = _rng_states(reader, source_tp, source_pp)
    progress.report(final=True)
    return result


def _read_optimizer(reader: dcp_files.Reader, common: Dict[str, Any], num_layers: int,
                    progress: Progress) -> OptimizerState:
    saved = mcore_state.optimizer_common(common, reader.directory)
    per_param: Dict[str, Dict[str, torch.Tensor]] = {}
    for state in MOMENTS + MOMENTUM:
        found = _by_name(reader, mcore_names.optimizer_key(state, ""), num_layers, progress)
        for name, tensor in found.items():
            per_param.setdefault(name, {})[state] = tensor.float()
    if saved.step is not None:
        for entry in per_param.values():
            if "exp_avg" in entry:
                entry["step"] = torch.tensor(saved.step, dtype=torch.float32)
    names = ["muon", "decay", "no_decay"] if len(saved.param_groups) == 3 else ["decay", "no_decay"]
    hparams = {g.get("name", default): dict(g) for g, default in zip(saved.param_groups, names)}
    return OptimizerState(per_param, hparams, saved.grad_scaler)


def _rng_states(reader: dcp_files.Reader, tp: int, pp: int) -> Dict[Tuple[int, int], Any]:
    """{(tp_rank, pp_rank): RNG states} of the saving run's ranks, where stored."""
    out = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            key = mcore_names.object_key("rng_state", (pp_rank, tp_rank), (pp, tp))
            if reader.has_object(key):
                value = dcp_files.load_object(reader.read([], [key])[key], key)
                out[(tp_rank, pp_rank)] = value[0] if isinstance(value, list) else value
    return out


def _model_space(opt: OptimizerState, weights: Dict[str, torch.Tensor], half: bool,
                 placement: layout.Layout) -> ModelSpaceState:
    """The whole model's optimizer state as one rank's model-space state."""
    muon = "muon" in opt.group_hparams
    groups = placement.optimizer_groups(list(weights), muon=muon)
    params: List[ParamState] = []
    step = None
    for group_name, members in groups.items():
        keys = MOMENTUM if group_name == "muon" or "betas" not in opt.group_hparams.get(
            group_name, {"betas": None}) else MOMENTS
        for name in members:
            entry = opt.per_param.get(name, {})
            tensors = {k: entry[k] for k in keys if k in entry}
            if "step" in entry:
                step = float(entry["step"])
            if half:
                tensors[MAIN] = weights[name].float()
            params.append(ParamState(name, None, tensors, keys))
    param_groups = [{**opt.group_hparams.get(g, {}), "name": g} for g, m in groups.items() if m]
    return ModelSpaceState(params, param_groups, step, opt.grad_scaler)


def write_torch_dist(source: ModelCheckpoint, save_dir: str, dtype_name: Optional[str] = None,
                     iteration: Optional[Iteration] = None,
                     include_optimizer: bool = False) -> Iteration:
    """Write `source` as a torch_dist checkpoint into `save_dir` (which the caller stages):
    one process writes every tensor whole; returns the iteration written ('release' unless
    given). Training loads it at any TP x PP x DP."""
    saved_dtype = getattr(source.args, "params_dtype", None)
    dtype = (torch_dtype(dtype_name) if dtype_name else saved_dtype
             if isinstance(saved_dtype, torch.dtype) else source.weights[layout.WORD_EMBEDDINGS].dtype)
    iteration = "release" if iteration is None else iteration
    full = dict(source.weights)
    weights = cast_weights(full, dtype)
    opt = source.optimizer if include_optimizer else None
    if include_optimizer and opt is None:
        raise CheckpointError("--include-optimizer: the source checkpoint has no optimizer "
                              "state")
    rows = weights[layout.WORD_EMBEDDINGS].shape[0]
    args = target_args(source, 1, 1, dtype, rows, iteration)
    args.data_parallel_size, args.world_size = 1, 1
    state = _model_space(opt, full, dtype != torch.float32,
                         layout.Layout.of_args(args, 1, rows)) if opt else None
    common = mcore_state.build_common(
        args, iteration, scheduler=source.lr_scheduler if opt else None,
        optimizer=None if state is None else mcore_state.optimizer_part(state, distributed=False),
        distributed_optimizer=False)
    single = RankLayout(0, 1, 0, 1, 0, 1, 0, source.num_layers)
    rng = source.rng_states.get((0, 0)) if opt else None
    entries = save_entries(weights, single, state, common,
                           rng[0] if isinstance(rng, list) else rng)
    directory = checkpoint_dir(save_dir, iteration)
    os.makedirs(directory, exist_ok=True)
    record = dcp_files.write_rank_files(directory, 0, entries)
    write_common_pt(directory, entries, record)
    dcp_files.publish(directory, [record])
    write_tracker(save_dir, iteration)
    return iteration


def write_converted(source: ModelCheckpoint, save_dir: str, opts: Any) -> str:
    """The converter's write (opts: app.checkpoint.convert.ConvertOptions); returns what was
    written, in words."""
    iteration = opts.iteration
    if opts.include_optimizer and iteration is None:
        iteration = source.iteration
    written = write_torch_dist(source, save_dir, opts.target_params_dtype, iteration,
                               opts.include_optimizer)
    if (opts.target_tensor_model_parallel_size, opts.target_pipeline_model_parallel_size) != (1, 1):
        logger.warning("--target-*-parallel-size is ignored for --output-format torch_dist: "
                       "it loads at any layout")
    return f"torch_dist checkpoint (iteration {written}; loads at any TP x PP x DP)"
