"""What a checkpoint directory holds, read from file names alone, and whether a run can load it.

`detect(load, iteration)` is the one detection of what --load holds (a `SavedCheckpoint`: its
format, the iteration folder, the iteration and the saved layout); a load makes it once and
passes it down to the format's reader (app.checkpoint.formats). Both engines call
`check_loadable` before they read a single file, and the preflight check
(`app.training.planning.preflight`) uses the same functions, so a checkpoint that cannot be
loaded is refused with one message naming the directory, both layouts and the fix (the
conversion command), instead of an error from deep inside DeepSpeed or torch.

Three formats are recognised inside an `iter_XXXXXXX` (or `release`) directory:

- "torch" (the native path, Megatron-LM's legacy layout, `--ckpt-format torch`):
  `mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`, one file per tensor x pipeline
  (x expert-parallel) rank (data-parallel replicas write nothing of their own);
- "deepspeed": `mp_rank_{tp:02d}_model_states.pt` per tensor-parallel rank (per model-parallel
  rank pp_rank x TP + tp_rank with pipeline stages, read as TP x PP ranks), plus, with ZeRO,
  `[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt` per data-parallel x tensor rank
  (ZeRO's partitions of the optimizer states). At ZeRO-3, where the weights are partitioned
  too, the module files are per data-parallel x tensor rank as well:
  `zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt`;
- "torch_dist" (Megatron Core's `--ckpt-format torch_dist`, app.checkpoint.torch_dist):
  `metadata.json`, `.metadata` and `__<rank>_0.distcp` files; the native path loads it at any
  layout, so its saved TP x PP x DP (read from its common state) is only reported.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from app.checkpoint import CheckpointError, names
from app.checkpoint import files as ckpt_files
from app.checkpoint.legacy import per_rank as legacy
from app.checkpoint.mcore import state as mcore_state
from app.checkpoint.names import DEEPSPEED, HF, TORCH, TORCH_DIST
from app.checkpoint.torch_dist import dcp_files
from app.checkpoint.torch_dist.per_rank import read_common


CONVERTER = "tools/convert_checkpoint.py"


@dataclass
class SavedLayout:
    """The format and parallel layout of one saved iteration, from its file names."""

    directory: str
    format: str
    """TORCH, DEEPSPEED or TORCH_DIST."""
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: Optional[int]
    """ZeRO partitions of the optimizer states (DeepSpeed with ZeRO); None otherwise."""
    model_files: List[str] = field(default_factory=list)
    """Paths of the weight files present (Megatron: model_optim_rng.pt; DeepSpeed: model states)."""
    optimizer_files: List[str] = field(default_factory=list)
    """DeepSpeed's ZeRO optimizer partitions present (empty for Megatron: inside model files)."""
    missing: List[str] = field(default_factory=list)
    """Files that the layout implies but that are absent (an unfinished or damaged save)."""
    partitioned_weights: bool = False
    """ZeRO-3: the weights too are split over the data-parallel ranks (one module file per
    data-parallel x model-parallel rank, `zero_pp_rank_D_mp_rank_XX_model_states.pt`)."""
    expert_model_parallel_size: int = 1
    """Legacy files of a Mixture-of-Experts run: one per expert-parallel rank too."""

    def describe(self) -> str:
        if self.format == TORCH_DIST:
            return (f"torch_dist layout saved at tensor-parallel size "
                    f"{self.tensor_model_parallel_size}, pipeline-parallel size "
                    f"{self.pipeline_model_parallel_size}, data-parallel size "
                    f"{self.data_parallel_size} (resharded on load to any layout)")
        stage = "ZeRO-3 " if self.partitioned_weights else "ZeRO "
        dp = f", {stage}partitions over {self.data_parallel_size} data-parallel ranks" \
            if self.data_parallel_size else ""
        kind = "legacy Megatron (torch)" if self.format == TORCH else self.format
        ep = f", expert-parallel size {self.expert_model_parallel_size}" \
            if self.expert_model_parallel_size > 1 else ""
        return (f"{kind} layout, tensor-parallel size {self.tensor_model_parallel_size}, "
                f"pipeline-parallel size {self.pipeline_model_parallel_size}{ep}{dp}")


def _megatron_layout(directory: str) -> Optional[SavedLayout]:
    found = legacy.saved_layout(directory)  # the legacy format's file-name rule
    if found is None:
        return None
    tp, pp, ep = found
    present, missing = [], []
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                path = os.path.join(directory, names.rank_dir_name(t, p, pp, e, ep),
                                    names.MODEL_FILENAME)
                (present if os.path.isfile(path) else missing).append(path)
    return SavedLayout(directory, TORCH, tp, pp, None, present, [], missing,
                       expert_model_parallel_size=ep)


def _deepspeed_layout(directory: str, entries: List[str]) -> Optional[SavedLayout]:
    zero3 = {r: n for n in entries for r in [names.parse_zero3_model_file(n)] if r is not None}
    model = {r: n for n in entries for r in [names.parse_deepspeed_model_file(n)] if r is not None
             and names.parse_zero3_model_file(n) is None}
    parsed = {n: names.parse_deepspeed_optim_file(n) for n in entries}
    optim = {found[:2]: n for n, found in parsed.items() if found is not None}
    if not model and not optim and not zero3:
        return None
    tp = max(list(model) + [t for _, t in list(optim) + list(zero3)]) + 1
    dp = max(d for d, _ in list(optim) + list(zero3)) + 1 if optim or zero3 else None
    if zero3:  # ZeRO-3: one module file per data-parallel x model-parallel rank
        missing = [os.path.join(directory, names.deepspeed_model_file(t, d))
                   for t in range(tp) for d in range(dp) if (d, t) not in zero3]
        model_files = [os.path.join(directory, zero3[k])
                       for k in sorted(zero3, key=lambda k: (k[1], k[0]))]
    else:
        missing = [os.path.join(directory, names.deepspeed_model_file(t))
                   for t in range(tp) if t not in model]
        model_files = [os.path.join(directory, model[t]) for t in sorted(model)]
    if dp:
        bf16 = any(found[2] for found in parsed.values() if found is not None)
        missing += [os.path.join(directory, names.deepspeed_optim_file(d, t, bf16))
                    for d in range(dp) for t in range(tp) if (d, t) not in optim]
    return SavedLayout(directory, DEEPSPEED, tp, 1, dp, model_files,
                       [os.path.join(directory, optim[k]) for k in sorted(optim)], missing,
                       partitioned_weights=bool(zero3))


def _torch_dist_layout(directory: str) -> Optional[SavedLayout]:
    """A torch_dist checkpoint: its files from `.metadata` (those missing listed), its saved
    layout from the common state's args."""
    if not dcp_files.is_dcp_checkpoint(directory):
        return None
    layout = SavedLayout(directory, TORCH_DIST, 1, 1, 1)
    if not os.path.isfile(os.path.join(directory, dcp_files.DCP_METADATA)):
        layout.missing.append(os.path.join(directory, dcp_files.DCP_METADATA))
        return layout
    reader = dcp_files.Reader(directory, verify=False)  # the load verifies what it reads
    files = sorted({info.relative_path for info in reader.metadata.storage_data.values()})
    for name in files:
        path = os.path.join(directory, name)
        (layout.model_files if os.path.isfile(path) else layout.missing).append(path)
    if layout.missing:
        return layout
    args = read_common(reader).get("args")
    layout.tensor_model_parallel_size = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    layout.pipeline_model_parallel_size = int(getattr(args, "pipeline_model_parallel_size", 1)
                                              or 1)
    layout.data_parallel_size = int(getattr(args, "data_parallel_size", 1) or 1)
    return layout


def inspect_directory(directory: str) -> Optional[SavedLayout]:
    """The layout of the checkpoint in `directory` (an iter_XXXXXXX or release folder), or None
    when it holds none of the formats' files."""
    if not os.path.isdir(directory):
        return None
    entries = sorted(os.listdir(directory))
    return (_torch_dist_layout(directory) or _megatron_layout(directory)
            or _deepspeed_layout(directory, entries))


@dataclass(frozen=True)
class SavedCheckpoint:
    """What --load holds, detected once (`detect`) and passed down to the reader: its format
    name (app.checkpoint.names: TORCH, TORCH_DIST, DEEPSPEED or HF), the folder of the
    iteration read (`load` itself for Hugging Face), that iteration (None for Hugging Face and
    for a DeepSpeed tag that is no iteration, such as global_step100) and the saved layout from
    its file names (None for Hugging Face)."""

    load: str
    format: str
    folder: str
    iteration: Optional[names.Iteration]
    layout: Optional[SavedLayout] = None

    @property
    def tensor_pipeline_sizes(self) -> Optional[Tuple[int, int]]:
        """(TP, PP) of a legacy checkpoint, whose files are per rank; None for the formats that
        are read whole and split for any layout (torch_dist, DeepSpeed, Hugging Face)."""
        if self.format != TORCH or self.layout is None:
            return None
        return self.layout.tensor_model_parallel_size, self.layout.pipeline_model_parallel_size

    @property
    def expert_model_parallel_size(self) -> int:
        """EP of a legacy checkpoint's files (1 for the other formats)."""
        return self.layout.expert_model_parallel_size if self.format == TORCH and self.layout \
            else 1

    def numbered_iteration(self) -> names.Iteration:
        """The iteration read (a number or 'release'); CheckpointError when the pointer named a
        tag that is no iteration (DeepSpeed's global_stepN) where a Megatron layout needs one."""
        if self.iteration is None:
            raise CheckpointError(f"{self.folder} is not an iteration folder of a Megatron-layout "
                                  "checkpoint; pass --iteration N (or release)")
        return self.iteration


def detect(load: str, iteration: Optional[names.Iteration] = None) -> SavedCheckpoint:
    """The checkpoint in `load` (at `iteration` when given, else at the one its pointer file
    names), from file names (and torch_dist's small metadata.json); no checkpoint file is
    opened. FileNotFoundError when `load` does not exist; CheckpointError, naming what the
    folder holds and what was looked for, otherwise."""
    if not os.path.isdir(load):
        raise FileNotFoundError(f"--load {load} does not exist (a checkpoint directory or a "
                                "Hugging Face model directory)")
    if os.path.isfile(os.path.join(load, "config.json")):
        return SavedCheckpoint(load, HF, load, None)
    folder, found = names.resolve_iteration(load, iteration)
    saved = inspect_directory(folder)
    if saved is None:
        raise CheckpointError(
            f"{folder} holds neither DeepSpeed's mp_rank_XX_model_states.pt, Megatron's "
            f"mp_rank_XX/model_optim_rng.pt nor a torch_dist checkpoint's metadata (it holds: "
            f"{_listing(os.listdir(folder))}): not a checkpoint this converter reads, or an "
            "unfinished save")
    return SavedCheckpoint(load, saved.format, folder, found, saved)


def _listing(entries: List[str], shown: int = 6) -> str:
    """The first `shown` names of a folder listing, sorted, for an error message."""
    entries = sorted(entries)
    if not entries:
        return "nothing"
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(entries[:shown]) + more


def load_command_hint(load_dir: str, target_tp: int, target_pp: int, source_format: str,
                      target_ep: int = 1) -> str:
    """The conversion command that writes a Megatron-layout copy at the run's TP x PP (x EP)."""
    ep = f" --target-expert-model-parallel-size {target_ep}" if target_ep > 1 else ""
    return (f"python {CONVERTER} --input-format {source_format} --output-format torch "
            f"--load {load_dir} --save <new dir> --target-tensor-model-parallel-size {target_tp} "
            f"--target-pipeline-model-parallel-size {target_pp}{ep}, then --load <new dir>")


def loadable_problem(layout: Optional[SavedLayout], load_dir: str, *, deepspeed: bool,
                     tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                     data_parallel_size: int, load_optimizer: bool,
                     expert_model_parallel_size: int = 1) -> Optional[str]:
    """Why a run of this engine and layout cannot load `layout`, with the fix; None if it can."""
    if layout is None:
        return None  # nothing recognisable: the engine's own reader says what it expected
    tp, pp, ep = (tensor_model_parallel_size, pipeline_model_parallel_size,
                  expert_model_parallel_size)
    where = layout.directory
    if layout.missing:
        shown = ", ".join(os.path.relpath(p, where) for p in layout.missing[:4])
        more = f" and {len(layout.missing) - 4} more" if len(layout.missing) > 4 else ""
        return (f"checkpoint {where} is incomplete ({layout.describe()}): missing {shown}{more}; "
                "the save did not finish or files were lost: restore them, or write an earlier "
                f"complete iteration into {names.tracker_path(load_dir)}")
    if layout.format == TORCH_DIST:
        if deepspeed:
            return (f"checkpoint {where} is a torch_dist checkpoint, which the native path reads "
                    "(DeepSpeed reads its own files): resume it without --deepspeed (and its "
                    "--deepspeed_config)")
        return None  # any layout: it is resharded on load
    if deepspeed and layout.format == TORCH:
        return (f"checkpoint {where} is a Megatron-layout checkpoint of the native path "
                "(mp_rank_XX/model_optim_rng.pt), but this is a --deepspeed run, which reads "
                "DeepSpeed's files (mp_rank_XX_model_states.pt): resume it without --deepspeed "
                "(and its --deepspeed_config)")
    if not deepspeed and layout.format == DEEPSPEED:
        return (f"checkpoint {where} was written by DeepSpeed (mp_rank_XX_model_states.pt), but "
                "this run is on the native path: add --deepspeed --deepspeed_config <json> to "
                "resume it, or convert it: " + load_command_hint(load_dir, tp, pp, DEEPSPEED))
    saved_tp, saved_pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    if layout.format == DEEPSPEED and pp > 1 and saved_tp * saved_pp == tp * pp:
        # DeepSpeed numbers its files by model-parallel rank (pp_rank x TP + tp_rank), so the
        # names give TP x PP only; the engine checks the split against the saved args
        return partition_problem(layout, data_parallel_size) if load_optimizer else None
    if layout.format == TORCH and layout.expert_model_parallel_size != ep and load_optimizer:
        return (f"checkpoint {where} was saved at expert-parallel size "
                f"{layout.expert_model_parallel_size} and this run uses {ep}: its weights load "
                "at any expert-parallel size, its optimizer states (one file per rank) do not; "
                "pass --no-load-optim (or --finetune), or reshard it with the optimizer: "
                + load_command_hint(load_dir, tp, pp, TORCH, ep)
                + " (--ckpt-format torch_dist reshards everything on load)")
    if (saved_tp, saved_pp) != (tp, pp):
        change = (f"it was saved with tensor-parallel size {saved_tp} and pipeline-parallel size "
                  f"{saved_pp}; this run uses {tp} and {pp}")
        if layout.format == TORCH:
            return (f"checkpoint {where}: {change}; reshard it: "
                    + load_command_hint(load_dir, tp, pp, TORCH, ep))
        return (f"checkpoint {where}: {change}; DeepSpeed cannot change the tensor-parallel size "
                f"of a checkpoint: resume with --tensor-model-parallel-size {saved_tp}, or "
                "convert it to the native path at the new size: "
                + load_command_hint(load_dir, tp, pp, DEEPSPEED) + " (without --deepspeed)")
    return partition_problem(layout, data_parallel_size) if load_optimizer else None


def partition_problem(layout: SavedLayout, data_parallel_size: int,
                      context_parallel_sizes: Tuple[int, int] = (1, 1)) -> Optional[str]:
    """Why ZeRO's optimizer partitions of `layout` cannot be loaded by a run whose ZeRO splits
    over `data_parallel_size` ranks (data x context ranks; DeepSpeed cannot re-partition them),
    with the fixes; None if they can (or there are none). `context_parallel_sizes` is (saved,
    this run's): ZeRO partitions over data x context ranks, so a change of context size is a
    change of partition count, which the universal checkpoint handles as a DP change."""
    saved_dp = layout.data_parallel_size
    if layout.format != DEEPSPEED or not saved_dp or saved_dp == data_parallel_size:
        return None
    ranks = saved_dp * layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
    saved_cp, cp = context_parallel_sizes
    if (saved_cp, cp) == (1, 1):
        split = (f"over {saved_dp} data-parallel ranks, and this run has {data_parallel_size}")
        same = f"data-parallel size {saved_dp}"
    else:
        split = (f"over {saved_dp} data x context ranks (saved at context-parallel size "
                 f"{saved_cp}, data-parallel size {saved_dp // saved_cp}), and this run has "
                 f"{data_parallel_size} (context-parallel size {cp}, data-parallel size "
                 f"{data_parallel_size // cp})")
        same = f"data-parallel x context-parallel size {saved_dp}"
    return (f"checkpoint {layout.directory}: ZeRO split the optimizer states {split}; DeepSpeed "
            "cannot re-partition them in place: convert it to DeepSpeed's universal checkpoint,"
            " which it re-slices for any data-parallel (and context-parallel) size with the "
            f"optimizer states: {universal_command(layout.directory)}; or launch {ranks} ranks "
            f"({same}); or pass --no-load-optim to load the weights and continue the LR "
            "schedule with fresh optimizer states")


def universal_command(directory: str) -> str:
    """The conversion of the DeepSpeed checkpoint in `directory` (an iter_XXXXXXX folder) to a
    universal checkpoint beside it, and the flag that loads it."""
    return ("python -m deepspeed.checkpoint.ds_to_universal --input_folder "
            f"{directory} --output_folder {directory}_universal, then --universal-checkpoint")


def stage_problem(layout: Optional[SavedLayout], partitioned_run: bool,
                  load_optimizer: bool) -> Optional[str]:
    """Why a DeepSpeed run at ZeRO-3 (`partitioned_run`), or at another stage, cannot load
    `layout` saved at the other kind of stage, with the fix; None if it can. A ZeRO-3 run reads
    the weights of any DeepSpeed checkpoint itself when it loads no optimizer states."""
    if layout is None or layout.format != DEEPSPEED:
        return None
    where, universal = layout.directory, universal_command(layout.directory)
    if layout.partitioned_weights and not partitioned_run:
        return (f"checkpoint {where} was saved at ZeRO stage 3 (the weights partitioned too: "
                "zero_pp_rank_D_mp_rank_XX_model_states.pt), which DeepSpeed reads only at "
                "stage 3: resume with zero_optimization.stage 3 (ds_configs/zero3.json), or "
                f"convert it: {universal}")
    if partitioned_run and not layout.partitioned_weights and load_optimizer:
        return (f"checkpoint {where} was saved at ZeRO stage 0, 1 or 2, whose optimizer states "
                "ZeRO-3 cannot load: pass --no-load-optim (the weights and the LR schedule "
                f"continue, the optimizer states start fresh), or convert it: {universal}")
    return None


def check_loadable(load_dir: str, iteration: names.Iteration, *, deepspeed: bool,
                   tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                   data_parallel_size: int, load_optimizer: bool,
                   expert_model_parallel_size: int = 1) -> Optional[SavedLayout]:
    """Raise CheckpointError (see `loadable_problem`) when this run cannot load `iteration`
    under `load_dir`; return its layout (None when the directory holds no known files)."""
    layout = inspect_directory(names.checkpoint_dir(load_dir, iteration))
    refuse_unloadable(layout, load_dir, deepspeed=deepspeed,
                      tensor_model_parallel_size=tensor_model_parallel_size,
                      pipeline_model_parallel_size=pipeline_model_parallel_size,
                      data_parallel_size=data_parallel_size, load_optimizer=load_optimizer,
                      expert_model_parallel_size=expert_model_parallel_size)
    return layout


def refuse_unloadable(layout: Optional[SavedLayout], load_dir: str, **run: object) -> None:
    """`check_loadable` of a layout already detected (`inspect_directory`): CheckpointError
    with `loadable_problem(layout, load_dir, **run)` when there is one."""
    problem = loadable_problem(layout, load_dir, **run)  # type: ignore[arg-type]
    if problem:
        raise CheckpointError(problem)


def read_saved_state(layout: SavedLayout) -> dict:
    """The dict stored in the first weight file, memory-mapped (tensors are not read), loaded
    with weights_only and the checkpoint allow-list after its SHA-256 sidecar (when present) is
    verified: its `args`, `iteration`, `lr_scheduler` (for torch_dist: from the common state,
    and `rng_state` the keys of its RNG objects). CheckpointError (UnsafeCheckpointError
    for a file that would run code) naming the file otherwise."""
    if layout.format == TORCH_DIST:
        reader = dcp_files.Reader(layout.directory, verify=False)
        common = read_common(reader)
        rng = [key for key in reader.keys() if key.startswith("rng_state/")]
        return {"args": common.get("args"), "iteration": common.get("iteration"),
                "lr_scheduler": mcore_state.scheduler_state(common), "rng_state": rng or None}
    path = layout.model_files[0]
    ckpt_files.verify_checksum(path)
    state = ckpt_files.safe_torch_load(path, "cpu", mmap=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} does not hold a dict")
    return state


def universal_tag(load_dir: str) -> str:
    """The tag `{load_dir}/latest_universal` names (written by DeepSpeed's ds_to_universal.py),
    which --universal-checkpoint loads; CheckpointError with the conversion command if absent."""
    tag = names.read_latest_tag(load_dir, names.LATEST_UNIVERSAL_FILENAME)
    if tag is None:
        latest = os.path.join(load_dir, names.LATEST_UNIVERSAL_FILENAME)
        raise CheckpointError(
            f"--universal-checkpoint: {latest} does not exist; convert first with "
            f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {load_dir}/iter_N "
            f"--output_folder {load_dir}/iter_N_universal")
    return tag
