"""Where every file of a checkpoint lives, what it is called, and the pointer files that name the
latest one: the only place that spells a checkpoint name (no torch needed).

Megatron-LM's layout (the native engine's; app.checkpoint.legacy holds the file content)::

    {save}/latest_checkpointed_iteration.txt        the tracker: "<iteration>" or "release"
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}/model_optim_rng.pt             (PP == 1)
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt    (PP > 1)
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/model_optim_rng.pt
                                                    (expert parallelism: EP > 1)
    {save}/release/...                              a "release" checkpoint

DeepSpeed's layout (the DeepSpeed engine's), under the same `iter_{iteration:07d}` tag::

    {save}/latest                                   DeepSpeed's pointer: the tag, no newline
    {save}/latest_universal                         written by ds_to_universal.py
    {save}/{tag}/mp_rank_{mp:02d}_model_states.pt   per model-parallel rank mp (pp x TP + tp)
    {save}/{tag}/zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt   instead, at ZeRO-3: per
                                                    data-parallel x model-parallel rank
    {save}/{tag}/[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   ZeRO partitions

Each pointer file has one reader and one writer here; writers replace the file atomically and
durably. The parsers accept wider rank numbers than the padding (rank 100 is `mp_rank_100`).
"""
from __future__ import annotations

import os
import re
from typing import Callable, List, Optional, Tuple, Union

from app.checkpoint import CheckpointError
from app.utils.fileio import atomic_write_bytes

Iteration = Union[int, str]  # an iteration number or "release"

# ---------------------------------------------------------------------------- format names

TORCH = "torch"
"""Megatron-LM's legacy format (`--ckpt-format torch`): mp_rank_XX[_YYY]/model_optim_rng.pt."""
TORCH_DIST = "torch_dist"
"""Megatron Core's distributed checkpoint (`--ckpt-format torch_dist`): PyTorch DCP files."""
DEEPSPEED = "deepspeed"
"""DeepSpeed's layout (ZeRO-1/2/3, and ds_to_universal's universal checkpoint)."""
HF = "hf"
"""A Hugging Face GPT-2 directory (save_pretrained's config.json and weights)."""
FORMATS = (TORCH, TORCH_DIST, DEEPSPEED, HF)
FORMAT_ALIASES = {"megatron": TORCH, "legacy": TORCH, "huggingface": HF}
"""Older spellings accepted on the command line (`megatron` was the converter's legacy name)."""


def canonical_format(name: str, flag: str = "--input-format") -> str:
    """The canonical name of format `name` (an alias allowed); ValueError naming `flag`."""
    found = FORMAT_ALIASES.get(name, name)
    if found not in FORMATS:
        raise ValueError(f"{flag} {name!r}: use one of {', '.join(FORMATS)} "
                         f"(or the alias{'es' if len(FORMAT_ALIASES) > 1 else ''} "
                         f"{', '.join(FORMAT_ALIASES)})")
    return found

RELEASE = "release"
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
LATEST_FILENAME = "latest"
LATEST_UNIVERSAL_FILENAME = "latest_universal"

_ITERATION_TAG = re.compile(r"^iter_(\d{7,})$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2,})((?:_\d{3,}){0,2})$")
_DS_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d{2,})_model_states\.pt$")
_DS_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2,})_optim_states\.pt$")


# ---------------------------------------------------------------------------- iterations

def iteration_tag(iteration: Iteration) -> str:
    """`iter_{iteration:07d}`, or "release": the directory name of an iteration (both engines)."""
    if iteration == RELEASE:
        return RELEASE
    return f"iter_{int(iteration):07d}"


def tag_iteration(name: str) -> Optional[int]:
    """The iteration an `iter_XXXXXXX` name stands for; None for any other name."""
    match = _ITERATION_TAG.match(name)
    return int(match.group(1)) if match else None


def checkpoint_dir(save_dir: str, iteration: Iteration) -> str:
    """`{save_dir}/iter_{iteration:07d}`, or `{save_dir}/release` for "release"."""
    return os.path.join(save_dir, iteration_tag(iteration))


SAVE_MARKER_PREFIX = ".save-in-progress."
"""Each rank writing a save marks its iteration directory with `{prefix}{host}.{pid}` before any
file and removes the mark once the save is committed: a directory still marked and not named by
the tracker is an interrupted save, never a checkpoint."""


def save_marker_path(directory: str, host: str, pid: int) -> str:
    """The save-in-progress mark of one process in the iteration `directory`."""
    return os.path.join(directory, f"{SAVE_MARKER_PREFIX}{host}.{pid}")


def interrupted_saves(save_dir: str) -> List[int]:
    """Iterations under `save_dir` whose directory still carries a save-in-progress mark and
    that the tracker does not name (their save was killed before it was committed)."""
    if not os.path.isdir(save_dir):
        return []
    tracker = read_tracker_text(save_dir)
    found = []
    for iteration in list_checkpoint_iterations(save_dir):
        if tracker is not None and tracker.strip() == str(iteration):
            continue  # committed; only the removal of its marks was interrupted
        directory = checkpoint_dir(save_dir, iteration)
        try:
            if any(n.startswith(SAVE_MARKER_PREFIX) for n in os.listdir(directory)):
                found.append(iteration)
        except OSError:
            continue
    return found


def list_checkpoint_iterations(save_dir: str) -> List[int]:
    """Iterations that have an `iter_XXXXXXX` directory under `save_dir`, ascending."""
    if not os.path.isdir(save_dir):
        return []
    found = (tag_iteration(name) for name in os.listdir(save_dir))
    return sorted(i for i in found if i is not None)


# ---------------------------------------------------------------------------- Megatron files

def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                  ep_size: int = 1) -> str:
    """Megatron's get_checkpoint_name: `mp_rank_{tp:02d}`, then `_{pp:03d}` when PP > 1, then
    `_{ep:03d}` (the expert-parallel rank) when EP > 1."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep_size > 1 else "")


def parse_rank_dir(name: str) -> Optional[Tuple[int, ...]]:
    """The numbers of a `mp_rank_XX[_YYY[_ZZZ]]` folder name: (tp_rank,) and the one or two
    suffixes (`mp_rank_XX_YYY` is a pipeline rank, or an expert-parallel rank when the run had
    EP > 1 and PP 1: the saved args tell); None for any other name (DeepSpeed's
    `mp_rank_XX_model_states.pt` included)."""
    match = _RANK_DIR.match(name)
    if not match:
        return None
    return (int(match.group(1)),) + tuple(int(n) for n in match.group(2).split("_")[1:])


def checkpoint_path(save_dir: str, iteration: Iteration, *, tp_rank: int = 0, pp_rank: int = 0,
                    pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Path of one rank's `model_optim_rng.pt` for `iteration`."""
    return os.path.join(checkpoint_dir(save_dir, iteration),
                        rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
                        MODEL_FILENAME)


# ---------------------------------------------------------------------------- DeepSpeed files

def deepspeed_model_file(mp_rank: int, dp_rank: Optional[int] = None) -> str:
    """`mp_rank_{mp:02d}_model_states.pt`: DeepSpeed's module file of model-parallel rank mp;
    with `dp_rank` (ZeRO-3, where every data-parallel rank writes one)
    `zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt`."""
    prefix = "" if dp_rank is None else f"zero_pp_rank_{dp_rank}_"
    return f"{prefix}mp_rank_{mp_rank:02d}_model_states.pt"


def parse_deepspeed_model_file(name: str) -> Optional[int]:
    """The model-parallel rank of a DeepSpeed module file name (either form of
    `deepspeed_model_file`); None for other names."""
    match = _DS_MODEL_FILE.match(name)
    return int(match.group(2)) if match else None


def parse_zero3_model_file(name: str) -> Optional[Tuple[int, int]]:
    """(dp_rank, mp_rank) of a ZeRO-3 module file name `zero_pp_rank_D_mp_rank_XX_model_states.pt`;
    None for other names (ZeRO-0/1/2's `mp_rank_XX_model_states.pt` included)."""
    match = _DS_MODEL_FILE.match(name)
    if not match or match.group(1) is None:
        return None
    return int(match.group(1)), int(match.group(2))


def deepspeed_optim_file(dp_rank: int, mp_rank: int, bf16: bool = False) -> str:
    """`[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`: ZeRO's optimizer partition
    of data-parallel rank dp and model-parallel rank mp (the prefix with DeepSpeed's bf16)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def parse_deepspeed_optim_file(name: str) -> Optional[Tuple[int, int, bool]]:
    """(dp_rank, mp_rank, bf16 prefix) of a ZeRO optimizer file name; None for other names."""
    match = _DS_OPTIM_FILE.match(name)
    if not match:
        return None
    return int(match.group(2)), int(match.group(3)), bool(match.group(1))


# ---------------------------------------------------------------------------- pointer files

def tracker_path(save_dir: str) -> str:
    """`{save_dir}/latest_checkpointed_iteration.txt`."""
    return os.path.join(save_dir, TRACKER_FILENAME)


def _read_pointer(path: str) -> Optional[str]:
    """The stripped text of a small pointer file; None when it does not exist."""
    if not os.path.isfile(path):
        return None
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        return f.read().strip()


def read_tracker_text(save_dir: str) -> Optional[str]:
    """The tracker's text as written, stripped; None when there is no tracker (`read_tracker`
    checks and interprets it)."""
    return _read_pointer(tracker_path(save_dir))


def read_tracker(load_dir: str) -> Optional[Iteration]:
    """The iteration the tracker names (an int or "release"); None when there is no tracker.

    Raises CheckpointError, naming the file and the fix, when the tracker is empty or not a
    number, or names a directory that does not exist.
    """
    text = read_tracker_text(load_dir)
    if text is None:
        return None
    path = tracker_path(load_dir)
    available = list_checkpoint_iterations(load_dir)
    hint = (f"complete iterations may be among {available}; write one of them into it"
            if available else "delete it to start from scratch")
    if text == RELEASE:
        iteration: Iteration = RELEASE
    elif re.fullmatch(r"\d+", text):
        iteration = int(text)
    else:
        raise CheckpointError(f"tracker file {path} holds {text!r}, not an iteration number or "
                              f"'release'; {hint}")
    directory = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"tracker file {path} names iteration {iteration}, but "
                              f"{directory} does not exist; {hint}")
    return iteration


def write_tracker(save_dir: str, iteration: Iteration,
                  before_replace: Optional[Callable[[str], None]] = None) -> None:
    """Atomically and durably replace the tracker with `iteration` (no newline, as Megatron).
    `before_replace(tmp)` runs once the temporary file is complete (a test seam)."""
    atomic_write_bytes(tracker_path(save_dir), str(iteration).encode("ascii"), durable=True,
                       before_replace=before_replace)


def read_latest_tag(directory: str, file_name: str = LATEST_FILENAME) -> Optional[str]:
    """The tag DeepSpeed's `latest` (or `latest_universal`, by `file_name`) names under
    `directory`, stripped; None when the file does not exist."""
    return _read_pointer(os.path.join(directory, file_name))


def resolve_iteration(load_dir: str, iteration: Optional[Iteration] = None
                      ) -> Tuple[str, Optional[Iteration]]:
    """(folder, iteration) to read in `load_dir`: `iteration`'s folder when given; else the tag
    DeepSpeed's `latest` names (its iteration None for a tag like global_step100); else the
    iteration the tracker names. CheckpointError naming what the folder holds otherwise."""
    if iteration is not None:
        folder = checkpoint_dir(load_dir, iteration)
        if not os.path.isdir(folder):
            raise CheckpointError(f"--iteration {iteration}: {folder} does not exist (iterations "
                                  f"present: {list_checkpoint_iterations(load_dir)})")
        return folder, iteration
    tag = read_latest_tag(load_dir)
    if tag and os.path.isdir(os.path.join(load_dir, tag)):
        return os.path.join(load_dir, tag), RELEASE if tag == RELEASE else tag_iteration(tag)
    tracked = read_tracker(load_dir)  # CheckpointError when it names a missing folder
    if tracked is not None:
        return checkpoint_dir(load_dir, tracked), tracked
    listing = sorted(os.listdir(load_dir)) if os.path.isdir(load_dir) else []
    raise CheckpointError(
        f"--load {load_dir} is not a checkpoint: it has no {TRACKER_FILENAME} (Megatron), no "
        f"'{LATEST_FILENAME}' file naming a tag (DeepSpeed) and no config.json (Hugging Face) "
        f"(it holds: {', '.join(listing[:6]) or 'nothing'}{' ...' if len(listing) > 6 else ''}); "
        "point --load at a run's --save directory, or pass --iteration N")


def write_latest_tag(directory: str, tag: str) -> None:
    """Atomically and durably replace DeepSpeed's `latest` with `tag` (no newline, as DeepSpeed)."""
    atomic_write_bytes(os.path.join(directory, LATEST_FILENAME), tag.encode("ascii"),
                       durable=True)
