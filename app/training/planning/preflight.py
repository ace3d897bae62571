"""Preflight: check a run's configuration, data, checkpoint and memory without training.

`pretrain_gpt2.py ... --dry-run` (and tools/preflight.py) builds the RunConfig the run would
build and calls the checks here; each adds findings to one `Report`, printed at the end. No
process group is started, no model is built and nothing is written except the token-range
cache a real run would write too; a run of any size is planned from one process
(`--dry-run-world-size`). A check that fails is an error naming the flag or file and the fix;
the command exits non-zero when there is any error.

The checkpoint section has no policy of its own: it calls the decision functions the real
start-up calls (app.training.resilience.save_dir, resume.decide_start, resume.check_resume), in
the same order, so a dry run passes exactly when the run would get past its start-up checks.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

from app.config import DataConfig, RunConfig, samples_per_split
from app.config.batch_schedule import check_divisible
from app.config.unread import unread_flags
from app.data.legacy_order import sample_order
from app.data.mock_dataset import describe_mock_plan
from app.data.plan import order_record, plan_datasets
from app.checkpoint import CheckpointError
from app.checkpoint import files as ckpt_files
from app.checkpoint import model_args, saved_layout
from app.checkpoint.torch_dist import dcp_files
from app.launch import interfaces
from app.launch.hardware import fp8_problem
from app.optim import OptimizerParamScheduler
from app.training.planning.data_check import check_data
from app.training.planning.memory import (FIT_FRACTION, estimate_memory,
                                          expert_params_per_rank, params_per_rank)
from app.training.telemetry import flops
from app.training.checkpointing.data_order import check_data_order, resume_order
from app.training.checkpointing.resume import (ResumeTarget, check_resume, check_saved_args,
                                            decide_start, require_rng_state)
from app.training.resilience.save_dir import held_by_live_run, save_dir_problem

GIB = float(1 << 30)
LEVELS = ("ok", "note", "warn", "ERROR")


@dataclass
class Report:
    """Findings grouped by section, in the order they were added."""

    sections: List[Tuple[str, List[Tuple[str, str]]]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    name: str = "preflight"
    title: str = "preflight (--dry-run)"

    def section(self, title: str) -> None:
        self.sections.append((title, []))

    def add(self, level: str, message: str) -> None:
        assert level in LEVELS, level
        if not self.sections:
            self.section("preflight")
        self.sections[-1][1].append((level, message))

    def ok(self, message: str) -> None:
        self.add("ok", message)

    def note(self, message: str) -> None:
        self.add("note", message)

    def warn(self, message: str) -> None:
        self.add("warn", message)

    def error(self, message: str) -> None:
        self.add("ERROR", message)

    def count(self, level: str) -> int:
        return sum(1 for _, items in self.sections for lvl, _ in items if lvl == level)

    @property
    def errors(self) -> List[str]:
        return [msg for _, items in self.sections for lvl, msg in items if lvl == "ERROR"]

    def render(self) -> str:
        """The report as text: one block per section, then a summary line."""
        lines = [f"{'=' * 20} {self.title} {'=' * 20}"]
        for title, items in self.sections:
            lines.append(f"[{title}]")
            lines.extend(f"  {level:<5} {message}" for level, message in items)
        elapsed = time.perf_counter() - self.started
        errors, warnings = self.count("ERROR"), self.count("warn")
        verdict = "FAILED" if errors else "passed"
        lines.append(f"{self.name} {verdict}: {errors} error(s), {warnings} warning(s) "
                     f"in {elapsed:.1f} s")
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.2f} MiB"


# ---------------------------------------------------------------------------- configuration

def describe_config(report: Report, cfg: RunConfig, device_type: Optional[str] = None) -> None:
    """The layout, batch sizes and engine the flags (and the DeepSpeed JSON) resolve to, and
    the flags this run does not read or that change nothing on `device_type`
    (app.config.unread)."""
    p, t, m = cfg.parallel, cfg.training, cfg.model
    report.ok(p.megatron_layout() + " (Megatron-LM's first line)")
    context = (f" x context {p.context_parallel_size} ({p.cp_comm_type}, "
               f"{m.seq_length // p.context_parallel_size} tokens of each sequence per rank)"
               if p.context_parallel_size > 1 else "")
    report.ok(f"world size {p.world_size} = tensor {p.tensor_model_parallel_size} x pipeline "
              f"{p.pipeline_model_parallel_size} x data {p.data_parallel_size}{context}")
    samples = cfg.batch_schedule.samples_in(t.train_iters)
    report.ok(f"global batch {t.global_batch_size} = micro-batch {t.micro_batch_size} x "
              f"{t.num_micro_batches(p.data_parallel_size)} micro-batches x data-parallel "
              f"{p.data_parallel_size}; {t.train_iters} iterations = "
              f"{samples:,} samples = {samples * m.seq_length:,} tokens")
    _describe_batch_schedule(report, cfg)
    report.ok(f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
              f"heads, seq {m.seq_length}, vocab {cfg.raw_vocab_size} padded to "
              f"{m.padded_vocab_size}, {m.num_parameters():,} parameters, weights "
              f"{m.params_dtype}")
    _describe_megatron_options(report, cfg)
    if m.moe.enabled:
        report.ok(describe_moe(cfg))
    if cfg.deepspeed.enabled:
        ds = cfg.deepspeed.config or {}
        zero = (ds.get("zero_optimization") or {}).get("stage", 0)
        half = "fp16" if ds.get("fp16", {}).get("enabled") else \
            "bf16" if ds.get("bf16", {}).get("enabled") else "fp32"
        report.ok(f"DeepSpeed JSON {cfg.deepspeed.config_path} agrees with the flags: ZeRO stage "
                  f"{zero}, {half}, train_batch_size {ds.get('train_batch_size')}, "
                  f"gradient_accumulation_steps {ds.get('gradient_accumulation_steps')}")
    else:
        report.ok("engine: native")
    for note in unread_flags(cfg, device_type):
        report.warn(note)
    r = cfg.rollback
    if r.enabled:
        report.ok(f"--rollback-on-spike: spikes over {r.window} iterations (z-score {r.zscore:g}, "
                  f"+{r.min_increase:.0%}), at most {r.max_rollbacks} rollback(s); the training "
                  f"split holds {r.max_rollbacks} x --save-interval "
                  f"{cfg.checkpoint.save_interval} extra iterations of data for the skipped windows")


def _describe_megatron_options(report: Report, cfg: RunConfig) -> None:
    """One line naming the Megatron model, loss and optimizer options in effect (the RoPE
    scaling factor used: Megatron's own GPT builder always uses 8); the flags that change
    nothing are app.config.unread's."""
    m, o = cfg.model, cfg.optimizer
    used = [name for name, on in (
        ("LayerNorm-1p (1 + weight)", m.layernorm_zero_centered_gamma),
        ("squared ReLU", m.squared_relu),
        ("QKV bias without other linear biases", m.qkv_bias and not m.add_bias_linear),
        (f"RoPE positions / {m.rotary_seq_len_interpolation_factor}",
         m.rotary_seq_len_interpolation_factor not in (None, 1)),
        ("per-token loss (sum over the global batch's tokens / their count)",
         cfg.training.calculate_per_token_loss),
        ("gradients accumulated and reduced in bf16", cfg.precision.grad_reduce_in_bf16)) if on]
    if m.use_rope_scaling:
        used.append(f"Llama 3.1 RoPE scaling, factor {m.rope_scaling_factor:g} (Megatron-LM's "
                    "own GPT builder uses 8 whatever --rope-scaling-factor says)")
    if o.decoupled_lr_range:
        used.append("embeddings and output layer at LR {:g} -> {:g} (--decoupled-lr)".format(
            *o.decoupled_lr_range))
    if used:
        report.ok("Megatron options: " + "; ".join(used))


def describe_moe(cfg: RunConfig) -> str:
    """Mixture of Experts in the dry run: experts and layers, the expert grid, total and active
    parameters, the experts each rank holds, and the active FLOPs MFU counts."""
    m, p = cfg.model, cfg.parallel
    moe = m.moe
    per_expert = (3 if m.swiglu else 2) * moe.moe_ffn_hidden_size * m.hidden_size
    idle = moe.num_moe_layers(m.num_layers) * (moe.num_experts - moe.moe_router_topk) * per_expert
    return (f"mixture of experts: {moe.num_experts} experts, top-{moe.moe_router_topk}, in "
            f"{moe.num_moe_layers(m.num_layers)} of {m.num_layers} layers "
            f"({moe.moe_token_dispatcher_type} dispatcher); expert grid expert-tensor "
            f"{p.expert_tensor_parallel_size} x expert {p.expert_model_parallel_size} x "
            f"expert-data {p.expert_data_parallel_size} x pipeline "
            f"{p.pipeline_model_parallel_size}; parameters {m.num_parameters():,} in all, "
            f"{m.num_parameters() - idle:,} active per token; routed experts per rank "
            f"{expert_params_per_rank(cfg):,} of its {params_per_rank(cfg):,}; model FLOPs per "
            f"token {flops.model_flops_per_token(m) / 1e6:,.2f} MFLOP (active parameters, "
            "Megatron's formula: MFU counts these)")


def _describe_batch_schedule(report: Report, cfg: RunConfig) -> None:
    """The batch-size schedule's batches, micro-batches and where each starts."""
    schedule, t, dp = cfg.batch_schedule, cfg.training, cfg.parallel.data_parallel_size
    if not schedule.varies:
        return
    flag = ("--rampup-batch-size " + " ".join(map(str, t.rampup_batch_size))
            if schedule.rampup else f"--step-batch-size-schedule {t.step_batch_size_schedule!r}")
    sizes = schedule.sizes_from(0, t.train_iters)
    try:
        check_divisible(sizes, t.micro_batch_size, dp, flag)
    except ValueError as exc:
        report.error(str(exc))
        return
    report.ok(f"{flag}: global batch {' -> '.join(map(str, sizes))}, micro-batches "
              f"{' -> '.join(str(b // (t.micro_batch_size * dp)) for b in sizes)} per "
              "data-parallel rank; the LR schedule counts samples (warmup "
              f"{cfg.optimizer.lr_warmup_samples:,}, decay {cfg.optimizer.lr_decay_samples:,})")


# ---------------------------------------------------------------------------- checkpoint

def _verify_integrity(report: Report, layout: saved_layout.SavedLayout) -> bool:
    """A torch_dist checkpoint's files against its integrity.json, as loading verifies them."""
    try:
        reader = dcp_files.Reader(layout.directory)
        if reader.manifest is None:
            report.note(f"{layout.directory} has no {dcp_files.INTEGRITY_FILE} to verify")
            return True
        reader.verify(reader.manifest)
    except CheckpointError as exc:
        report.error(str(exc))
        return False
    report.ok(f"all {len(reader.manifest)} checkpoint file(s) match "
              f"{dcp_files.INTEGRITY_FILE}")
    return True


def _verify_checksums(report: Report, files: Sequence[str]) -> bool:
    """Every file against its SHA-256 sidecar, as loading verifies it; False after an error."""
    checked = 0
    for path in files:
        if os.path.isfile(ckpt_files.sidecar_path(path)):
            try:
                ckpt_files.verify_checksum(path)
                checked += 1
            except CheckpointError as exc:
                report.error(str(exc))
                return False
    if checked == len(files):
        report.ok(f"all {checked} checkpoint file(s) match their SHA-256 sidecars")
    else:
        report.note(f"{len(files) - checked} of {len(files)} checkpoint file(s) have no SHA-256 "
                    "sidecar to verify")
    return True


def _check_schedule(report: Report, cfg: RunConfig, saved: Optional[dict]) -> None:
    """The saved LR schedule loads under this run's flags (the check the resume will make)."""
    if not saved:
        return
    import torch
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    try:
        OptimizerParamScheduler(optimizer, cfg.optimizer).load_state_dict(saved)
    except ValueError as exc:
        report.error(str(exc))


def _check_data_order(report: Report, cfg: RunConfig, saved: Any,
                      data_order: Optional[Callable[[int], dict]], where: str) -> None:
    """The data-order choice and check a resume makes (app.training.checkpointing.data_order);
    `data_order(version)` is this run's record in the order of that version."""
    writer = model_args.checkpoint_writer(saved)
    report.ok(f"written by {writer.describe()}")
    if data_order is None or not int(getattr(saved, "iteration", 0) or 0):
        return
    try:
        version, why = resume_order(getattr(saved, "data_order", None), writer,
                                    cfg.checkpoint.allow_data_order_change)
        report.ok(f"data order of this resume: {why}")
        consumed = {name: int(getattr(saved, f"consumed_{name}_samples", 0) or 0)
                    for name in ("train", "valid")}
        lines = check_data_order(getattr(saved, "data_order", None), data_order(version), where,
                                 consumed, cfg.checkpoint.allow_data_order_change)
    except (CheckpointError, ValueError) as exc:
        report.error(str(exc))
        return
    for line in lines:
        report.note(line)
    if not lines:
        report.ok("the data order is the checkpoint's (seed, sequence length, datasets, "
                  "weights, documents, epochs)")


def _check_saved_state(report: Report, cfg: RunConfig, target: ResumeTarget,
                       data_order: Optional[Callable[[int], dict]]) -> None:
    """What loading will check in the saved state, read without its tensors: the model shape
    (`check_saved_args`, as the engines call it), the RNG states the plan restores, the LR
    schedule under these flags, where the run resumes and whether its data order is kept."""
    layout, plan = target.layout, target.plan
    try:
        state = saved_layout.read_saved_state(layout)
    except CheckpointError as exc:
        report.error(str(exc))
        return
    saved = state.get("args")
    try:
        if saved is not None or not cfg.deepspeed.enabled:  # DeepSpeed's reader skips no args
            check_saved_args(plan, saved, cfg, layout.directory,
                             reshardable=layout.format == saved_layout.TORCH_DIST)
    except CheckpointError as exc:
        report.error(f"{layout.directory}: {exc}")
        return
    try:
        require_rng_state(plan, state.get("rng_state"), layout.directory)
    except CheckpointError as exc:
        report.error(str(exc))
        return
    if saved is None:
        report.warn("the checkpoint stores no 'args': its model shape cannot be checked")
        return
    report.ok(f"model shape matches ({', '.join(model_args.MODEL_SHAPE_FIELDS[:-1])})")
    saved_dtype = str(getattr(saved, "params_dtype", "")).replace("torch.", "")
    if saved_dtype and saved_dtype != cfg.model.params_dtype:
        report.warn(f"weights were saved as {saved_dtype} and this run trains "
                    f"{cfg.model.params_dtype}: they are cast on load (python "
                    f"{saved_layout.CONVERTER} --target-params-dtype converts a copy)")
    if not plan.load_optimizer:
        report.ok("weights only (--finetune, --no-load-optim or a release checkpoint)")
        return
    if "scheduler" not in (cfg.deepspeed.config or {}):  # else DeepSpeed's own schedule
        _check_schedule(report, cfg, state.get("lr_scheduler"))
    iteration = getattr(saved, "iteration", None)
    if iteration is not None:
        left = cfg.training.train_iters - int(iteration)
        report.ok(f"resumes at iteration {iteration} (consumed samples "
                  f"{getattr(saved, 'consumed_train_samples', '?')}); "
                  + (f"{left} iteration(s) left" if left > 0 else
                     "nothing left to train: raise --train-iters to continue"))
    _check_data_order(report, cfg, saved, data_order, layout.directory)


def check_checkpoint(report: Report, cfg: RunConfig,
                     data_order: Optional[Callable[[int], dict]] = None) -> None:
    """The start-up decisions of a real run (app.training.pretrain), made by the same functions
    in the same order but without writing anything: --save can be created and written
    (`save_dir_problem`) and no live run holds its writer lock (`held_by_live_run`; the lock is
    not taken); resume, fresh start or refusal (`decide_start`, with --overwrite-checkpoints,
    --finetune, --no-load-*); the saved layout against this run's engine and TP/PP/DP
    (`check_resume`). Then what loading would find: checksums, model shape, RNG, LR schedule,
    and (given this run's record in each order, `data_order(version)`) which order the resume
    reads and whether it keeps it."""
    report.section("checkpoint")
    c = cfg.checkpoint
    if c.save:
        problem = save_dir_problem(c.save) or held_by_live_run(c.save)
        (report.error(problem) if problem else
         report.ok(f"--save {c.save} is writable and no other run holds its writer lock"))
    else:
        report.note("no --save: no checkpoint will be written")
    try:
        decision = decide_start(c)
        if decision.warning:
            report.warn(decision.warning)
        if decision.load is None:
            report.ok(decision.note or "no --load: training starts from randomly initialised "
                                       "weights")
            return
        target = check_resume(cfg, decision.load)
    except CheckpointError as exc:
        report.error(str(exc))
        return
    if target.layout is None:
        report.ok(f"--load {c.load} --universal-checkpoint: tag {target.universal_tag} "
                  "(latest_universal), which DeepSpeed re-slices for this layout")
        return
    report.ok(f"--load {c.load}: iteration {target.plan.iteration}, {target.layout.describe()}")
    if target.layout.format == saved_layout.TORCH_DIST:
        p = cfg.parallel
        report.ok(f"it loads resharded to this run's tensor-parallel size "
                  f"{p.tensor_model_parallel_size}, pipeline-parallel size "
                  f"{p.pipeline_model_parallel_size}, data-parallel size {p.data_parallel_size}; "
                  f"this run saves --ckpt-format {c.ckpt_format}")
        if _verify_integrity(report, target.layout):
            _check_saved_state(report, cfg, target, data_order)
        return
    if c.save:
        report.ok(f"this run saves --ckpt-format {c.ckpt_format}")
    if _verify_checksums(report, target.layout.model_files + target.layout.optimizer_files):
        _check_saved_state(report, cfg, target, data_order)


# ---------------------------------------------------------------------------- memory

def device_memory(override_gib: Optional[float]) -> Tuple[Optional[float], str, str]:
    """(bytes per rank, description, device type) of the device the run will use: the
    override, else the first CUDA device, else (None, ..., "cpu")."""
    if override_gib is not None:
        return override_gib * GIB, f"{override_gib:g} GiB (--dry-run-device-memory)", "cuda"
    import torch
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{_gib(props.total_memory)} ({props.name})", "cuda"
    return None, "no CUDA device", "cpu"


def check_fp8(report: Report, cfg: RunConfig, override_gib: Optional[float]) -> None:
    """FP8 (--fp8-format) needs Transformer Engine on FP8-capable GPUs: checked on this
    machine, or counted and stated for the GPUs of --dry-run-device-memory."""
    if not cfg.fp8.enabled:
        return
    _, desc, _ = device_memory(override_gib)
    report.section("fp8")
    report.ok(cfg.fp8.recipe())
    if override_gib is not None:
        report.ok(f"planned for GPUs of {desc}: they need Transformer Engine and FP8 tensor cores "
                  "(compute capability >= 8.9; not checked from here); FLOPs are counted as in "
                  "Megatron-LM (no precision term), MFU against the bf16 peak")
        return
    problem = fp8_problem(cfg.fp8)
    (report.error(problem) if problem else report.ok("this machine can run FP8"))


def check_memory(report: Report, cfg: RunConfig, override_gib: Optional[float]) -> None:
    """Per-rank estimate (formulas in app.training.planning.memory) against the device memory, and the
    largest micro-batch that fits."""
    report.section("memory (per rank)")
    total_bytes, desc, device_type = device_memory(override_gib)
    est = estimate_memory(cfg, device_type=device_type)
    buckets = (f" + reduce buckets {_gib(est.buffers)}" if est.buffers else "") + (
        f" + gathered parameters {_gib(est.gathered)}" if est.gathered else "")
    report.ok(f"weights {_gib(est.weights)} + gradients {_gib(est.gradients)} + optimizer states "
              f"{_gib(est.optimizer)}{buckets} + activations {_gib(est.activations)} "
              f"(micro-batch {est.micro_batch_size}) = {_gib(est.total)}")
    for note in est.notes:
        report.note(note)
    if total_bytes is None:
        report.note(f"{desc}: pass --dry-run-device-memory <GiB> to check the fit on the GPUs "
                    "the run will use")
        return
    largest = est.largest_micro_batch(total_bytes)
    per_dp = cfg.training.global_batch_size // cfg.parallel.data_parallel_size
    dividing = max((b for b in range(1, min(largest, per_dp) + 1) if per_dp % b == 0), default=0)
    fit = (f"largest micro-batch that fits: {largest}" + (
        f" ({dividing} divides the {per_dp} samples per data-parallel rank)" if largest else ""))
    budget = FIT_FRACTION * total_bytes
    if est.total <= budget:
        report.ok(f"fits {desc} ({_gib(est.total)} <= {FIT_FRACTION:.0%} of it); {fit}")
        return
    hint = (f"lower --micro-batch-size to {dividing}" if dividing else
            "the model states alone do not fit: raise --tensor-model-parallel-size or "
            "--pipeline-model-parallel-size"
            + (" (or --expert-model-parallel-size)" if cfg.model.moe.enabled else "")
            + ", or use a DeepSpeed ZeRO stage / optimizer offload")
    report.error(f"estimated {_gib(est.total)} per rank exceeds {FIT_FRACTION:.0%} of {desc}; "
                 f"{fit}: {hint}, or add --checkpoint-activations")


def describe_mock_data(report: Report, cfg: Optional[RunConfig]) -> None:
    """--mock-data: the synthetic samples each split will serve (no file to check), counted
    without building their indices."""
    report.section("data")
    if cfg is None:
        report.note("--mock-data: no data files; the sample counts follow from a valid "
                    "configuration")
        return
    for line in describe_mock_plan(samples_per_split(cfg), cfg.model.seq_length,
                                   cfg.raw_vocab_size, cfg.training.seed):
        report.ok(f"--mock-data: {line}; no data files read")


def run_checks(report: Report, cfg: Optional[RunConfig], *, data: Optional[DataConfig],
               vocab_size: Optional[int], device_memory_gib: Optional[float]) -> Report:
    """Every check that can run: the configuration, data (or the --mock-data samples),
    checkpoint and memory sections; with `cfg` None (the configuration failed, already
    reported) only the data files of `data`."""
    if cfg is not None:
        report.section("configuration")
        describe_config(report, cfg, device_memory(device_memory_gib)[2])
        report.add(*interfaces.describe_choice(cfg.parallel.distributed_backend))
    data = cfg.data if cfg else data
    plan = None
    if data is not None and data.mock_data:
        describe_mock_data(report, cfg)
    else:
        plan = check_data(report, data, samples_per_split(cfg) if cfg else None,
                          cfg.model.seq_length if cfg else 1, vocab_size)
    if cfg is not None:
        check_checkpoint(report, cfg, None if plan is None else lambda version: order_record(
            plan if version == plan.order.version else plan_datasets(
                plan.blends, cfg.data.split, samples_per_split(cfg), cfg.model.seq_length,
                cfg.data.mmap_bin_files, sample_order(version)), cfg.training.seed))
        check_memory(report, cfg, device_memory_gib)
        check_fp8(report, cfg, device_memory_gib)
    return report
