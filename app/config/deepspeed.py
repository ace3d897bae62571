"""The DeepSpeed path's configuration: `DeepSpeedConfig` (its flags) and the DeepSpeed JSON
read once and reconciled with the command line (`load_ds_json`, `reconcile_ds_config`; pure
functions, no deepspeed import). Part of `app.config`.

Rules (each violation raises ValueError naming the JSON file, the key, the flag and both values):
- Batch sizes: `train_micro_batch_size_per_gpu` = --micro-batch-size, `gradient_accumulation_steps`
  = --global-batch-size / (--micro-batch-size x data-parallel size), `train_batch_size` =
  --global-batch-size. Keys the JSON leaves out are filled from the command line.
- `gradient_clipping` = --clip-grad (filled when absent).
- Precision: `fp16.enabled` / `bf16.enabled` must agree with the run's precision (filled when
  absent or "auto"); arguments.py takes the precision from the JSON when no flag is given.
- If the JSON defines `optimizer`, its `params.lr` (and weight decay, betas, eps when given) must
  agree with the command line; if it also defines `scheduler`, our LR schedule is not used and
  explicit command-line schedule flags are rejected.
- --optimizer sgd hands DeepSpeed a torch SGD, which ZeRO takes only with
  `zero_allow_untested_optimizer` set in the JSON (refused otherwise).
- Muon under DeepSpeed is DeepSpeed's ZeRO-aware Muon, `"optimizer": {"type": "Muon"}` in the
  JSON (`--optimizer muon` follows from it); an explicit --optimizer must agree with the JSON's
  type. DeepSpeed's Muon has fixed settings (Nesterov, Keller Jordan's coefficients, 5 steps,
  shape scaling, no QKV split; `params.ns_method` picks its precision), so of the --muon-* flags
  only --muon-momentum (= `params.momentum`) is taken, and --muon-tp-mode blockwise, which TP > 1
  needs: it orthogonalises each tensor-parallel shard alone. It tells matrices from embeddings by
  name, so an untied output layer (which it would give to Muon) is refused.
- Mixture of Experts (`check_moe_deepspeed`, from app.config.moe): ZeRO-1/2 only (ZeRO-3 refused
  in DeepSpeed's words; at ZeRO-0 DeepSpeed clips by the mean of the ranks' norms), tensor,
  pipeline and expert-tensor parallel size 1, ZeRO-2's `contiguous_gradients` and
  `reduce_scatter` on (DeepSpeed's MoE asserts them), no --universal-checkpoint (DeepSpeed's
  universal format has no native-MoE expert layout).
- ZeRO stage 0 to 3. At stage 3 `zero_optimization.memory_efficient_linear` is filled with false
  and, with Muon, `reduce_scatter` with false (`_reconcile_zero3`); pipeline parallelism with
  stage 3 is refused in app.config.run (DeepSpeed's pipeline engine does not take it).
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Iterable, Optional, Tuple

from app.config.options import option

RunConfig = Any
"""The type of the `cfg` arguments below: app.config.run.RunConfig (which holds a
DeepSpeedConfig, so this module cannot import it)."""

MUON_FIXED_FLAGS = ("--muon-nesterov", "--muon-no-split-qkv", "--muon-scale-mode",
                    "--muon-num-ns-steps", "--muon-coefficient-type", "--muon-fp32-matmul-prec",
                    "--muon-extra-scale-factor", "--muon-scalar-optimizer")
"""Megatron Muon settings that DeepSpeed's Muon does not take."""
JSON_TYPES = {"adam": ("adam", "adamw"), "sgd": ("sgd",), "muon": ("muon",)}
"""The JSON optimizer types each --optimizer agrees with."""
SCHEDULE_FLAGS = ("--lr-decay-style", "--lr-decay-iters", "--lr-warmup-iters",
                  "--lr-warmup-fraction", "--warmup", "--min-lr")


@dataclass(kw_only=True)
class DeepSpeedConfig:
    """The DeepSpeed path: enabled by --deepspeed with --deepspeed_config <json>. `enabled`,
    `config_path` and `mpi` are DeepSpeed's own flags (deepspeed.add_config_arguments), which
    arguments.py maps here; `config` is the JSON reconciled with the command line
    (`reconcile_ds_config`), what deepspeed.initialize receives."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "DeepSpeed path", "this project's options of the --deepspeed path")

    enabled: bool = False
    config_path: Optional[str] = None
    config: Optional[Dict[str, Any]] = None
    activation_checkpointing: bool = option(
        "--deepspeed-activation-checkpointing", default=False,
        help="run the recompute chosen by --recompute-granularity (or --checkpoint-activations) "
             "through deepspeed.checkpointing, with the JSON's activation_checkpointing settings;"
             " needs --deepspeed")
    universal_checkpoint: bool = option(
        "--universal-checkpoint", default=False,
        help="load a DeepSpeed universal checkpoint (ds_to_universal.py output, named by --load's"
             " latest_universal) at any DP/TP size")
    mpi: bool = option(
        "--deepspeed_mpi", default=False,
        help="discover ranks through mpi4py")

    def __post_init__(self) -> None:
        if self.enabled and not self.config_path:
            raise ValueError("--deepspeed needs --deepspeed_config <path to JSON> (see ds_configs/)")
        if self.activation_checkpointing and not self.enabled:
            raise ValueError("--deepspeed-activation-checkpointing needs --deepspeed (without it "
                             "the recompute runs through our own checkpoint function; drop the "
                             "flag)")
        if self.universal_checkpoint and not self.enabled:
            raise ValueError("--universal-checkpoint needs --deepspeed (a DeepSpeed universal "
                             "checkpoint); for Megatron checkpoints use tools/convert_checkpoint.py")


def load_ds_json(path: str) -> Dict[str, Any]:
    """Read the DeepSpeed JSON, with a message naming the file when it is missing or malformed."""
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {path}: no such file (see ds_configs/ for examples)")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--deepspeed_config {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--deepspeed_config {path} must hold a JSON object")
    return data


def _agree(ds: Dict[str, Any], key: str, value: Any, flag: str, path: str) -> None:
    if key not in ds:
        ds[key] = value
    elif ds[key] != value:
        raise ValueError(f"{path}: \"{key}\" is {ds[key]} but the command line gives {value} "
                         f"({flag}); make them agree or drop \"{key}\" from the JSON")


def _reconcile_precision(ds: Dict[str, Any], cfg: RunConfig, path: str) -> None:
    """`fp16.enabled` / `bf16.enabled` must agree with the run's precision (filled when absent
    or "auto"). arguments.py has already taken the precision from the JSON when no flag was
    given, so a disagreement here is a flag contradicting the JSON."""
    p = cfg.precision
    run = "--fp16" if p.fp16 else "--bf16" if p.bf16 else "fp32 (no --fp16/--bf16)"
    for key, wanted in (("fp16", p.fp16), ("bf16", p.bf16)):
        block = ds.setdefault(key, {})
        if block.get("enabled", "auto") == "auto":
            block["enabled"] = wanted
        elif bool(block["enabled"]) != wanted:
            raise ValueError(f"{path}: \"{key}.enabled\" is {str(block['enabled']).lower()} but "
                             f"the command line asks for {run}; make them agree (drop the flag "
                             f"to use the JSON's precision, or change \"{key}.enabled\")")


LOSS_SCALE_FLAGS = {"--loss-scale": "loss_scale", "--initial-loss-scale": "initial_scale_power",
                    "--min-loss-scale": "min_loss_scale",
                    "--loss-scale-window": "loss_scale_window", "--hysteresis": "hysteresis"}


def _reconcile_loss_scale(ds: Dict[str, Any], cfg: RunConfig, path: str,
                          explicit_flags: Iterable[str]) -> None:
    """Loss-scale flags given on the command line go into the JSON's fp16 block (or must agree)."""
    given = [f for f in explicit_flags if f in LOSS_SCALE_FLAGS]
    p = cfg.precision
    if not given or not p.fp16:  # without fp16 they are not read (app.config.unread warns)
        return
    initial, minimum, window, hysteresis = p.dynamic_scaler_settings()
    power = math.log2(initial)
    if "--initial-loss-scale" in given and not float(power).is_integer():
        raise ValueError(f"--initial-loss-scale ({initial}) must be a power of two "
                         "(DeepSpeed takes it as fp16.initial_scale_power)")
    values = {"loss_scale": p.loss_scale or 0, "min_loss_scale": minimum,
              "initial_scale_power": int(round(power)),
              "loss_scale_window": window, "hysteresis": hysteresis}
    block = ds["fp16"]
    for flag in given:
        key = LOSS_SCALE_FLAGS[flag]
        if key in block and block[key] != values[key]:
            raise ValueError(f"{path}: \"fp16.{key}\" is {block[key]} but {flag} gives "
                             f"{values[key]}; make them agree")
        block[key] = values[key]


def _reconcile_optimizer(ds: Dict[str, Any], cfg: RunConfig, path: str,
                         explicit_flags: Iterable[str]) -> None:
    opt = ds.get("optimizer")
    if opt is None:
        if cfg.optimizer.optimizer == "muon":
            raise ValueError(f"--optimizer muon with --deepspeed runs DeepSpeed's ZeRO-aware Muon, "
                             f"set in the JSON: add \"optimizer\": {{\"type\": \"Muon\", "
                             f"\"params\": {{\"momentum\": 0.95}}}} to {path}, or drop "
                             "--deepspeed for Megatron's Muon")
        stage = ds.get("zero_optimization", {}).get("stage", 0)
        if (cfg.optimizer.optimizer == "sgd" and stage >= 1
                and not ds.get("zero_allow_untested_optimizer")):
            raise ValueError(f"{path}: --optimizer sgd under ZeRO stage {stage}: DeepSpeed steps "
                             "a torch SGD only with \"zero_allow_untested_optimizer\": true in "
                             "the JSON; add it, or use --optimizer adam")
        if "scheduler" in ds:
            raise ValueError(f"{path}: a \"scheduler\" without an \"optimizer\" would drive our "
                             "optimizer; drop the JSON scheduler (our --lr-* flags schedule the "
                             "LR) or define both")
        return
    _reconcile_optimizer_type(opt, cfg, path, explicit_flags)
    params = opt.setdefault("params", {})
    o = cfg.optimizer
    for key, flag, value in (("lr", "--lr", o.lr), ("weight_decay", "--weight-decay", o.weight_decay),
                             ("eps", "--adam-eps", o.adam_eps)):
        if key in params and abs(float(params[key]) - value) > 1e-12 * max(1.0, abs(value)):
            raise ValueError(f"{path}: optimizer.params.{key} is {params[key]} but {flag} is "
                             f"{value}; make them agree")
        params.setdefault(key, value)
    betas = [o.adam_beta1, o.adam_beta2]
    if "betas" in params and [float(b) for b in params["betas"]] != betas:
        raise ValueError(f"{path}: optimizer.params.betas is {params['betas']} but "
                         f"--adam-beta1/--adam-beta2 give {betas}")
    params.setdefault("betas", betas)
    if "scheduler" in ds:
        clash = sorted(set(explicit_flags) & set(SCHEDULE_FLAGS))
        if clash:
            raise ValueError(f"{path} defines a \"scheduler\", which replaces our LR schedule, "
                             f"but the command line also sets {', '.join(clash)}; remove one")


def _reconcile_optimizer_type(opt: Dict[str, Any], cfg: RunConfig, path: str,
                              explicit_flags: Iterable[str]) -> None:
    """An explicit --optimizer agrees with the JSON's type; DeepSpeed's Muon takes
    --muon-momentum and needs blockwise TP and tied embeddings (module docstring)."""
    o, explicit = cfg.optimizer, set(explicit_flags)
    json_type = str(opt.get("type", "")).lower()
    if "--optimizer" in explicit and json_type not in JSON_TYPES[o.optimizer]:
        raise ValueError(f"{path}: optimizer.type is {opt.get('type')!r} but --optimizer is "
                         f"{o.optimizer}; make them agree or drop one")
    if json_type != "muon":
        return
    fixed = sorted(explicit & set(MUON_FIXED_FLAGS))
    if fixed:
        raise ValueError(f"{path} selects DeepSpeed's Muon, which does not take "
                         f"{', '.join(fixed)} (it always uses Nesterov momentum, Keller Jordan's "
                         "coefficients, 5 steps, shape scaling, no QKV split; optimizer.params."
                         "ns_method picks its precision); drop them, or drop --deepspeed for "
                         "Megatron's Muon")
    tp = cfg.parallel.tensor_model_parallel_size
    if tp > 1 and not ("--muon-tp-mode" in explicit and o.muon_tp_mode == "blockwise"):
        raise ValueError(f"{path}: DeepSpeed's Muon orthogonalises each of the {tp} tensor-"
                         "parallel shards of a matrix alone; pass --muon-tp-mode blockwise to "
                         "accept that, or drop --deepspeed for the TP-invariant duplicated or "
                         "distributed modes")
    if cfg.model.untie_embeddings_and_output_weights:
        raise ValueError(f"{path}: DeepSpeed's Muon tells matrices from embeddings by name and "
                         "would orthogonalise the untied output layer; drop "
                         "--untie-embeddings-and-output-weights, or drop --deepspeed")
    if "--muon-momentum" in explicit:
        params = opt.setdefault("params", {})
        if "momentum" in params and float(params["momentum"]) != o.muon_momentum:
            raise ValueError(f"{path}: optimizer.params.momentum is {params['momentum']} but "
                             f"--muon-momentum is {o.muon_momentum}; make them agree")
        params["momentum"] = o.muon_momentum


def reconcile_ds_config(ds_json: Dict[str, Any], cfg: RunConfig,
                        path: str = "<deepspeed config>",
                        explicit_flags: Iterable[str] = ()) -> Dict[str, Any]:
    """Return a copy of `ds_json` filled from, and checked against, the run configuration."""
    ds = copy.deepcopy(ds_json)
    t, dp = cfg.training, cfg.parallel.data_parallel_size
    gas = t.num_micro_batches(dp)
    _agree(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, "--micro-batch-size", path)
    _agree(ds, "gradient_accumulation_steps", gas,
           f"--global-batch-size {t.global_batch_size} / (--micro-batch-size "
           f"{t.micro_batch_size} x data-parallel size {dp})", path)
    _agree(ds, "train_batch_size", t.global_batch_size, "--global-batch-size", path)
    _agree(ds, "gradient_clipping", float(cfg.optimizer.clip_grad), "--clip-grad", path)
    _reconcile_precision(ds, cfg, path)
    _reconcile_loss_scale(ds, cfg, path, explicit_flags)
    _reconcile_optimizer(ds, cfg, path, explicit_flags)
    if cfg.deepspeed.universal_checkpoint:
        ds.setdefault("checkpoint", {})["load_universal"] = True
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{path}: zero_optimization.stage {stage} is not a ZeRO stage "
                         "(use 0, 1, 2 or 3)")
    if stage == 3:
        _reconcile_zero3(ds, path)
    return ds


def _reconcile_zero3(ds: Dict[str, Any], path: str) -> None:
    """ZeRO-3: DeepSpeed's F.linear replacement off unless asked for (it would replace
    torch.nn.functional.linear for the whole process, the native path's too); with DeepSpeed's
    Muon, `reduce_scatter` off (its ZeRO-3 Muon refuses it: each gradient is orthogonalised
    whole)."""
    zero = ds["zero_optimization"]
    zero.setdefault("memory_efficient_linear", False)
    if str((ds.get("optimizer") or {}).get("type", "")).lower() != "muon":
        return
    if zero.get("reduce_scatter", False):
        raise ValueError(f"{path}: DeepSpeed's Muon at ZeRO stage 3 needs "
                         "zero_optimization.reduce_scatter false (it orthogonalises each "
                         "gradient whole); set it to false or drop it")
    zero["reduce_scatter"] = False


def offloads_optimizer(ds: Dict[str, Any]) -> bool:
    """True when ZeRO offloads the optimizer to the CPU (DeepSpeedCPUAdam is then required)."""
    zero = ds.get("zero_optimization", {})
    device = zero.get("offload_optimizer", {}).get("device", "none")
    return device == "cpu" or bool(zero.get("cpu_offload"))


def zero_stage(ds: Optional[Dict[str, Any]]) -> int:
    """The JSON's zero_optimization.stage (0 without a JSON or a ZeRO block)."""
    return int(((ds or {}).get("zero_optimization") or {}).get("stage", 0))


def check_moe_deepspeed(ds: DeepSpeedConfig, parallel: Any) -> None:
    """The rules of Mixture of Experts on the DeepSpeed path (module docstring), one ValueError
    line each naming the flag or JSON key and the way that works; DeepSpeed's own words where
    DeepSpeed refuses the same (ZeRO-3, ZeRO-2's gradient settings)."""
    path, zero = ds.config_path, (ds.config or {}).get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage == 3:
        raise ValueError("Native DeepSpeed MoE is not supported with ZeRO Stage 3. Use AutoEP or "
                         f"choose ZeRO stage 1/2. ({path}: --num-experts at ZeRO stage 3)")
    if ds.config is not None and stage == 0:
        raise ValueError(f"{path}: --num-experts at ZeRO stage 0 is not supported (DeepSpeed "
                         "clips there by the data-parallel mean of each rank's gradient norm, "
                         "not the norm of all experts): use ZeRO stage 1 or 2 "
                         "(ds_configs/zero1.json, zero2.json)")
    for flag, size, why in (
            ("--tensor-model-parallel-size", parallel.tensor_model_parallel_size,
             "DeepSpeed's expert groups follow another rank order than Megatron's with TP"),
            ("--pipeline-model-parallel-size", parallel.pipeline_model_parallel_size,
             "one DeepSpeed engine per stage would split the expert groups"),
            ("--expert-tensor-parallel-size", parallel.expert_tensor_parallel_size,
             "DeepSpeed's MoE does not split an expert over ranks")):
        if size > 1:
            raise ValueError(f"--num-experts with --deepspeed and {flag} {size} is not supported "
                             f"({why}): use expert parallelism (--expert-model-parallel-size) "
                             f"with ZeRO-1/2, or drop --deepspeed for {flag} with MoE")
    if stage == 2:
        for key, words in (("contiguous_gradients", "Contiguous Gradients"),
                           ("reduce_scatter", "Reduce Scatter")):
            if not zero.get(key, True):
                raise ValueError(f"{words} in ZeRO Stage 2 must be set to True for MoE. ({path}:"
                                 f" set zero_optimization.{key} to true)")
    if ds.universal_checkpoint:
        raise ValueError("--universal-checkpoint with --num-experts is not supported (DeepSpeed's "
                         "universal checkpoint has no layout for its native MoE experts): "
                         "resume at the saved layout, or convert the checkpoint with "
                         "tools/convert_checkpoint.py --input-format deepspeed")
