"""Which format a checkpoint directory holds, judged from its file names (and torch_dist's
small metadata.json; no checkpoint file is opened).

`detect_format` is what the converter, tools/generate.py, the server and the lm-eval backend
call when they are given `--load DIR`; each format is one branch of it:

    hf          DIR/config.json (Hugging Face save_pretrained)
    deepspeed   DIR/{tag}/mp_rank_XX_model_states.pt (ZeRO-3: zero_pp_rank_D_mp_rank_XX_model_states.pt),
                the tag named by DIR/latest
                (our runs: iter_0000100; DeepSpeed's own default: global_step100)
    megatron    DIR/iter_0000100/mp_rank_XX[_YYY]/model_optim_rng.pt, the iteration named by
                DIR/latest_checkpointed_iteration.txt (Megatron-LM's legacy layout; ours)
    torch_dist  DIR/iter_0000100/{metadata.json, .metadata, __<rank>_0.distcp} (Megatron Core's
                --ckpt-format torch_dist; the small metadata.json names the backend)
"""
from __future__ import annotations

import os
from typing import List, Optional

from app.checkpointing import CheckpointError, dcp_files, names

HF = "hf"
DEEPSPEED = "deepspeed"
MEGATRON = "megatron"
TORCH_DIST = "torch_dist"


def detect_format(load: str, iteration: Optional[names.Iteration] = None) -> str:
    """'hf', 'deepspeed', 'megatron' or 'torch_dist': the format of the checkpoint in `load` (at `iteration`
    when given, else at the one its pointer file names). FileNotFoundError when `load` does not
    exist; CheckpointError, naming what the folder holds and what was looked for, otherwise."""
    if not os.path.isdir(load):
        raise FileNotFoundError(f"--load {load} does not exist (a checkpoint directory or a "
                                "Hugging Face model directory)")
    if os.path.isfile(os.path.join(load, "config.json")):
        return HF
    folder = _iteration_folder(load, iteration)
    entries = os.listdir(folder)
    if dcp_files.is_dcp_checkpoint(folder):
        return TORCH_DIST
    if any(names.parse_deepspeed_model_file(name) is not None for name in entries):
        return DEEPSPEED
    if any(names.parse_rank_dir(name) is not None for name in entries):
        return MEGATRON
    raise CheckpointError(
        f"{folder} holds neither DeepSpeed's mp_rank_XX_model_states.pt, Megatron's "
        f"mp_rank_XX/model_optim_rng.pt nor a torch_dist checkpoint's metadata (it holds: {_listing(entries)}): not a checkpoint this "
        "converter reads, or an unfinished save")


def _iteration_folder(load: str, iteration: Optional[names.Iteration]) -> str:
    """The folder of `iteration` under `load`, else of the tag DeepSpeed's `latest` names, else
    of the iteration the Megatron tracker names."""
    if iteration is not None:
        folder = names.checkpoint_dir(load, iteration)
        if not os.path.isdir(folder):
            raise CheckpointError(f"--iteration {iteration}: {folder} does not exist (iterations "
                                  f"present: {names.list_checkpoint_iterations(load)})")
        return folder
    tag = names.read_latest_tag(load)
    if tag and os.path.isdir(os.path.join(load, tag)):
        return os.path.join(load, tag)
    tracked = names.read_tracker(load)  # CheckpointError when it names a missing folder
    if tracked is not None:
        return names.checkpoint_dir(load, tracked)
    raise CheckpointError(
        f"--load {load} is not a checkpoint: it has no {names.TRACKER_FILENAME} (Megatron), no "
        f"'{names.LATEST_FILENAME}' file naming a tag (DeepSpeed) and no config.json (Hugging "
        f"Face) (it holds: {_listing(os.listdir(load))}); point --load at a run's --save "
        "directory, or pass --iteration N")


def _listing(entries: List[str], shown: int = 6) -> str:
    """The first `shown` names of a folder listing, sorted, for an error message."""
    entries = sorted(entries)
    if not entries:
        return "nothing"
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(entries[:shown]) + more
