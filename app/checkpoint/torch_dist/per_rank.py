"""Megatron-LM's `--ckpt-format torch_dist` for our GPT-2, per rank: every rank writes its own
shards, and a checkpoint saved at one TP x PP x DP loads at any other
(app.checkpoint.torch_dist.whole reads and writes the whole model in one process).

The directory of an iteration is Megatron Core's (app.checkpoint.torch_dist.dcp_files has the
files): the model tensors under Megatron Core's keys and global shapes
(app.checkpoint.mcore.names, layers stacked), the optimizer states beside them in model space
(`optimizer.state.<state>.<key>`, app.optim.model_space), and as ShardedObjects the common
state (`common_state`: args, iteration, checkpoint_version, opt_param_scheduler, the
optimizer's non-tensor part, content_metadata; also written as `common.pt`, the only place
Megatron Core 0.16-0.18 read it from, while 0.19 and later read either), each (pipeline,
tensor) rank's RNG states (`rng_state`, a (PP, TP) grid) and the layers' empty
`_extra_state`s. The tracker and iteration directory names are the legacy format's
(app.checkpoint.names).

Saving (`save_entries`, `start_save`): each rank turns its local tensors into boxes of the
global tensors (app.checkpoint.sharding), keeps those it must write (replicas are spread over
the data-parallel and, for replicated parameters, tensor-parallel ranks; the distributed
optimizer's shards are each written by their owner) and writes them in its own file, no rank
gathering another's tensors; then rank 0 gathers the small per-rank records and writes the
global metadata. The commit is app.checkpoint.commit's (crash-safe, one tracker, undo on any
failure), with the write step optionally in the background (--async-save).

Loading (`read_rank_state`): each rank reads exactly the boxes of its own local tensors and
optimizer pieces, whatever layout wrote them (torch's resharding read); a stored tensor of
another global shape is refused with the key and both shapes. Checkpoints written by
Megatron-LM itself are read the same way (its args may hold Megatron classes, read as inert
stand-ins).
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from app.checkpoint import CheckpointError, commit, sharding
from app.checkpoint.files import sha256_file
from app.checkpoint.mcore import names as mcore_names
from app.checkpoint.mcore import state as mcore_state
from app.checkpoint.names import Iteration, checkpoint_dir
from app.checkpoint.torch_dist import dcp_files
from app.checkpoint.torch_dist.dcp_files import Entry, RankFiles
from app.config.param_names import parse_layer
from app.optim.mixed_precision import check_saved_groups
from app.optim.model_space import MAIN, ModelSpaceState, ParamState
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
    the weights, data x context ranks with context parallelism: ParallelState.gradient_state);
    with Mixture of Experts its place in the expert grid too (expert tensor, expert and expert
    data-parallel ranks: an expert weight's TP split, its expert axis and its replicas), and
    whether the layers are stacked (False: Megatron's per-layer keys of a model whose layers are
    not all alike, mcore_names.stacks_layers)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    rank: int
    num_layers: int
    etp_rank: int = 0
    etp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1
    stacked: bool = True

    @classmethod
    def of(cls, parallel_state: Any, num_layers: int, stacked: bool = True) -> "RankLayout":
        ps = parallel_state
        return cls(ps.tensor_model_parallel_rank, ps.tensor_model_parallel_size,
                   ps.pipeline_model_parallel_rank, ps.pipeline_model_parallel_size,
                   ps.data_parallel_rank, ps.data_parallel_size, ps.rank, num_layers,
                   ps.expert_tensor_parallel_rank, ps.expert_tensor_parallel_size,
                   ps.expert_model_parallel_rank, ps.expert_model_parallel_size,
                   ps.expert_data_parallel_rank, ps.expert_data_parallel_size, stacked)


def rng_key(layout: RankLayout) -> str:
    """The DCP key of this (pipeline, tensor) rank's RNG states: `rng_state/shard_pp.tp_PP.TP`."""
    return mcore_names.object_key("rng_state", (layout.pp_rank, layout.tp_rank),
                                  (layout.pp_size, layout.tp_size))


def is_expert(tensor: torch.Tensor) -> bool:
    """An MoE layer's routed-expert weight (app.model.moe.experts' `expert_axis` mark)."""
    return getattr(tensor, "expert_axis", None) is not None


def placement(name: str, tensor: torch.Tensor, layout: RankLayout) -> sharding.Placement:
    """Where this rank's local `tensor` of parameter `name` lies in Megatron Core's global
    tensor (the TP split read from the parameter's own marks; an expert weight's split over
    the expert tensor-parallel ranks and its expert axis over the expert-parallel ranks)."""
    key, layer = mcore_names.to_mcore(name, layout.stacked)
    tp_rank, tp_size, experts = layout.tp_rank, layout.tp_size, None
    if is_expert(tensor):
        tp_rank, tp_size, experts = layout.etp_rank, layout.etp_size, tensor.expert_axis[1:]
    return sharding.place(key, tensor.shape, partition_dim=getattr(tensor, "partition_dim", -1),
                          tp_rank=tp_rank, tp_size=tp_size,
                          layer=layer if layout.stacked else None, num_layers=layout.num_layers,
                          replicated_rows=getattr(tensor, "replicated_rows", None),
                          glu_halves=getattr(tensor, "glu_halves", False), expert_axis=experts)


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
                                               region.copy_index, param_state.piece is None,
                                               is_expert(local))
                out.append((candidate, Entry(key, box, where.global_shape, region.global_offset)))
    return out


def save_entries(params: Dict[str, torch.Tensor], layout: RankLayout,
                 optimizer: Optional[ModelSpaceState], common: Optional[Dict[str, Any]],
                 rng_state: Optional[Dict[str, Any]]) -> List[Entry]:
    """Everything this rank writes: its share of the model and optimizer boxes, its layers'
    `_extra_state` objects (tensor rank 0, data rank 0; the experts': expert tensor rank 0,
    expert data rank 0), its RNG states (data rank 0) and, on rank 0 when given, the common
    state."""
    found: List[Tuple[sharding.Candidate, Entry]] = []
    for name, tensor in params.items():
        if name == mcore_names.TIED_COPY:
            continue  # a replica of the first stage's word embeddings
        where = placement(name, tensor, layout)
        for region in where.regions:
            box = _box(tensor.detach(), region, where.stacked)
            found.append((sharding.Candidate(where.key, region.global_offset,
                                             box.numel() * box.element_size(), region.copies,
                                             region.copy_index, True, is_expert(tensor)),
                          Entry(where.key, box, where.global_shape, region.global_offset)))
    if optimizer is not None:
        found += optimizer_entries_of(optimizer, params, layout)
    mine = sharding.assign_writers([c for c, _ in found], layout.dp_size, layout.dp_rank,
                                   layout.edp_size, layout.edp_rank)
    entries = [entry for (_, entry), keep in zip(found, mine) if keep]
    empty = dcp_files.object_bytes(None)
    entries += [Entry(key, data=empty) for key in extra_state_keys(params, layout)]
    if rng_state is not None and layout.dp_rank == 0:
        entries.append(Entry(rng_key(layout), data=dcp_files.object_bytes([rng_state])))
    if common is not None and layout.rank == 0:
        entries.append(Entry(COMMON_KEY, data=dcp_files.object_bytes(common)))
    return entries


def extra_state_keys(params: Dict[str, torch.Tensor], layout: RankLayout) -> List[str]:
    """The `_extra_state` objects this rank writes: of each linear layer it holds
    (mcore_names.EXTRA_STATE_OF) when it is tensor rank 0 and data rank 0; of each routed
    expert it holds when it is expert tensor rank 0 and expert data rank 0 (an unmarked expert
    tensor, the converter's, holds all experts)."""
    keys = []
    for name, tensor in params.items():
        parsed = parse_layer(name)
        module = mcore_names.EXTRA_STATE_OF.get(parsed[1]) if parsed else None
        if module is None:
            continue
        layer, stacked = parsed[0], layout.stacked
        if module in mcore_names.EXPERT_MODULES:
            if layout.etp_rank == 0 and layout.edp_rank == 0:
                _, ep_rank, ep_size = getattr(tensor, "expert_axis", (0, 0, 1))  # whole: all
                local = tensor.shape[0]
                total = local * ep_size
                keys += [mcore_names.extra_state_key(module, layer, layout.num_layers, stacked,
                                                     (ep_rank * local + j, total))
                         for j in range(local)]
        elif layout.tp_rank == 0 and layout.dp_rank == 0:
            keys.append(mcore_names.extra_state_key(module, layer, layout.num_layers, stacked))
    return sorted(keys)


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


def stored_stacked(reader: dcp_files.Reader) -> bool:
    """Whether the checkpoint stacks its layers (False when it holds Megatron's per-layer keys
    `decoder.layers.<i>.`, which a model with MoE and dense layers writes): read from its keys,
    so either form loads into a model of the same layers."""
    return not any(mcore_names.layer_of_key(key) is not None for key in reader.keys())


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
            "--ffn-hidden-size, --max-position-embeddings, --num-experts, "
            "--moe-ffn-hidden-size): a torch_dist checkpoint reshards over TP/PP/DP/EP, not "
            "over the model's shape")
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
    layout = dataclasses.replace(layout, stacked=stored_stacked(reader))
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
