"""DeepSpeed's checkpoint files read safely, without DeepSpeed's engine: the allow-list of the
classes DeepSpeed pickles, and one checked read (SHA-256 sidecar, weights_only) that the engine's
checkpoint I/O hook, the converter and the tools share."""
from __future__ import annotations

from typing import Any, List

from app.checkpoint import files as ckpt_files
from app.utils.third_party import prepare_deepspeed_import


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
    file that would run code, ckpt.CheckpointError for a damaged one."""
    ckpt_files.verify_checksum(path)
    return ckpt_files.safe_torch_load(path, map_location, deepspeed_safe_globals())
