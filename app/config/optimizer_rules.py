"""The --optimizer choices and the rules on Muon's flags (pure; app.config.OptimizerConfig and
RunConfig call them when they are built)."""
from __future__ import annotations

from typing import Any

OPTIMIZERS = ("adam", "sgd", "muon")
"""--optimizer choices (Megatron's names; adam is AdamW)."""
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
"""--muon-tp-mode: how Newton-Schulz treats a tensor-parallel shard (app/optim/muon.py)."""
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high")
MUON_SCALAR_OPTIMIZERS = ("adam",)


def check_optimizer_choice(config: Any) -> None:
    """--optimizer and the Muon flags of an OptimizerConfig: known names, steps >= 1, momenta
    in [0, 1); the message names the flag."""
    for flag, value, allowed in (
            ("--optimizer", config.optimizer, OPTIMIZERS),
            ("--muon-tp-mode", config.muon_tp_mode, MUON_TP_MODES),
            ("--muon-scale-mode", config.muon_scale_mode, MUON_SCALE_MODES),
            ("--muon-coefficient-type", config.muon_coefficient_type, MUON_COEFFICIENT_TYPES),
            ("--muon-fp32-matmul-prec", config.muon_fp32_matmul_prec, MUON_MATMUL_PRECISIONS),
            ("--muon-scalar-optimizer", config.muon_scalar_optimizer, MUON_SCALAR_OPTIMIZERS)):
        if value not in allowed:
            raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if config.muon_num_ns_steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be >= 1, got {config.muon_num_ns_steps}")
    for flag, value in (("--muon-momentum", config.muon_momentum),
                        ("--sgd-momentum", config.sgd_momentum)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{flag} must be in [0, 1), got {value}")


def check_muon_layout(config: Any, num_kv_heads: int, tensor_model_parallel_size: int) -> None:
    """--muon-no-split-qkv orthogonalises the fused QKV matrix whole, which a rank's rows do not
    tile when key/value heads are replicated over TP ranks (groups < TP): refused unless
    blockwise."""
    tp = tensor_model_parallel_size
    if (config.optimizer == "muon" and not config.muon_split_qkv
            and config.muon_tp_mode != "blockwise" and num_kv_heads < tp):
        raise ValueError(
            f"--muon-no-split-qkv with --muon-tp-mode {config.muon_tp_mode}: --num-query-groups "
            f"({num_kv_heads}) < --tensor-model-parallel-size ({tp}) replicates key/value rows "
            "over ranks, so the fused QKV matrix cannot be assembled from the shards; drop "
            "--muon-no-split-qkv (q, k and v are then orthogonalised apart) or use "
            "--muon-tp-mode blockwise")
