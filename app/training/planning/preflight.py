"""Preflight: check a run's configuration, data, checkpoint and memory without training.

`pretrain_gpt2.py ... --dry-run` (and tools/preflight.py) builds the RunConfig the run would
build and calls the checks here; each adds findings to one `Report`, printed at the end. No
process group is started, no model is built and nothing is written except the token-range
cache a real run would write too; a run of any size is planned from one process
(`--dry-run-world-size`). A check that fails is an error naming the flag or file and the fix;
the command exits non-zero when there is any error.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from app.config import RunConfig, samples_per_split, split_weights
from app.data.gpt_dataset import (SPLIT_NAMES, check_token_ids, samples_per_prefix,
                                  token_id_range)
from app.data.index_builder import compute_num_epochs, split_document_ranges
from app.data.indexed_dataset import MMapIndexedDataset
from app.checkpointing import megatron as ckpt
from app.checkpointing import files as ckpt_files
from app.checkpointing import layouts
from app.launch import interfaces
from app.training.planning.memory import FIT_FRACTION, estimate_memory
from app.training.resilience.resume import plan_resume

GIB = float(1 << 30)
LEVELS = ("ok", "note", "warn", "ERROR")


@dataclass
class Report:
    """Findings grouped by section, in the order they were added."""

    sections: List[Tuple[str, List[Tuple[str, str]]]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

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
        lines = ["==================== preflight (--dry-run) ===================="]
        for title, items in self.sections:
            lines.append(f"[{title}]")
            lines.extend(f"  {level:<5} {message}" for level, message in items)
        elapsed = time.perf_counter() - self.started
        errors, warnings = self.count("ERROR"), self.count("warn")
        verdict = "FAILED" if errors else "passed"
        lines.append(f"preflight {verdict}: {errors} error(s), {warnings} warning(s) "
                     f"in {elapsed:.1f} s")
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.2f} MiB"


# ---------------------------------------------------------------------------- configuration

def describe_config(report: Report, cfg: RunConfig) -> None:
    """The layout, batch sizes and engine the flags (and the DeepSpeed JSON) resolve to."""
    p, t, m = cfg.parallel, cfg.training, cfg.model
    report.ok(f"world size {p.world_size} = tensor {p.tensor_model_parallel_size} x pipeline "
              f"{p.pipeline_model_parallel_size} x data {p.data_parallel_size}")
    report.ok(f"global batch {t.global_batch_size} = micro-batch {t.micro_batch_size} x "
              f"{t.num_micro_batches(p.data_parallel_size)} micro-batches x data-parallel "
              f"{p.data_parallel_size}; {t.train_iters} iterations = "
              f"{t.train_iters * t.global_batch_size:,} samples = "
              f"{t.train_iters * t.global_batch_size * m.seq_length:,} tokens")
    report.ok(f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
              f"heads, seq {m.seq_length}, vocab {cfg.raw_vocab_size} padded to "
              f"{m.padded_vocab_size}, {m.num_parameters():,} parameters, weights "
              f"{m.params_dtype}")
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
    r = cfg.rollback
    if r.enabled:
        report.ok(f"--rollback-on-spike: spikes over {r.window} iterations (z-score {r.zscore:g}, "
                  f"+{r.min_increase:.0%}), at most {r.max_rollbacks} rollback(s); the training "
                  f"split holds {r.max_rollbacks} x --save-interval "
                  f"{cfg.checkpoint.save_interval} extra iterations of data for the skipped windows")


# ---------------------------------------------------------------------------- data

def _check_prefix(report: Report, prefix: str, needed: Sequence[int],
                  fractions: Tuple[float, float, float], seq_length: int,
                  vocab_size: Optional[int], cache_dir: Optional[str]) -> None:
    try:
        indexed = MMapIndexedDataset(prefix)
    except (ValueError, OSError) as exc:  # DatasetFormatError is a ValueError
        report.error(f"--data-path {prefix}: {exc}")
        return
    docs = indexed.num_documents
    lengths = indexed.document_token_ranges()[:, 1]
    report.ok(f"{prefix}: {docs:,} documents, {int(lengths.sum()):,} tokens ({indexed.dtype.name})")
    if docs == 0:
        report.error(f"{prefix} holds no documents; re-run tools/preprocess_data.py on a "
                     "non-empty input or leave it out of --data-path")
        return
    if vocab_size is not None:
        cache = cache_dir or os.path.dirname(os.path.abspath(prefix))
        lo, hi = token_id_range(indexed, cache)
        if lo >= 0 and hi < vocab_size:
            report.ok(f"{prefix}: token ids in [{lo}, {hi}], below the vocabulary size {vocab_size}")
        else:
            try:
                check_token_ids(indexed, vocab_size, cache)
            except ValueError as exc:
                report.error(str(exc))
    for name, (start, end), n in zip(SPLIT_NAMES, split_document_ranges(docs, fractions), needed):
        tokens = int(lengths[start:end].sum())
        if n <= 0:
            continue
        if end <= start or tokens == 0:
            level = report.error if name == "train" else report.warn
            level(f"{prefix}: the {name} split (--split) has no "
                  f"{'documents' if end <= start else 'tokens'} but {n:,} samples are needed"
                  + ("; give the first weight of --split a positive value" if name == "train"
                     else f"; {name} evaluation is skipped"))
            continue
        epochs = compute_num_epochs(tokens, seq_length, n)
        text = (f"{prefix}: {name} documents [{start:,}, {end:,}), {tokens:,} tokens -> "
                f"{n:,} samples need {epochs} epoch(s)")
        (report.warn if name == "train" and epochs > 1 else report.ok)(
            text + (" (the training data repeats)" if name == "train" and epochs > 1 else ""))


def check_data(report: Report, data_path: Sequence[str], split: str, seq_length: int,
               num_samples: Optional[Sequence[int]], vocab_size: Optional[int],
               cache_dir: Optional[str]) -> None:
    """Every dataset of the blend opens and validates, its token ids fit the vocabulary, and
    each split yields its samples (documents, tokens, epochs). `num_samples` None (the
    configuration failed) checks the files only."""
    report.section("data")
    try:
        fractions = split_weights(split)
        entries = samples_per_prefix(data_path, num_samples or (0, 0, 0))
    except ValueError as exc:
        report.error(str(exc))
        return
    for weight, prefix, needed in entries:
        if len(entries) > 1:
            report.note(f"blend weight {weight:.4f} for {prefix}")
        _check_prefix(report, prefix, needed, fractions, seq_length, vocab_size, cache_dir)


# ---------------------------------------------------------------------------- checkpoint

def _verify_checksums(report: Report, files: Sequence[str]) -> None:
    checked = 0
    for path in files:
        if os.path.isfile(ckpt_files.sidecar_path(path)):
            try:
                ckpt_files.verify_checksum(path)
                checked += 1
            except ckpt.CheckpointError as exc:
                report.error(str(exc))
                return
    if checked == len(files):
        report.ok(f"all {checked} checkpoint file(s) match their SHA-256 sidecars")
    else:
        report.note(f"{len(files) - checked} of {len(files)} checkpoint file(s) have no SHA-256 "
                    "sidecar to verify")


def _check_schedule(report: Report, cfg: RunConfig, saved: Optional[dict]) -> None:
    """The saved LR schedule loads under this run's flags (the check the resume will make)."""
    if not saved:
        return
    import torch
    from app.optim import OptimizerParamScheduler
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    try:
        OptimizerParamScheduler(optimizer, cfg.optimizer).load_state_dict(saved)
    except ValueError as exc:
        report.error(str(exc))


def _check_saved_state(report: Report, cfg: RunConfig, layout: layouts.SavedLayout,
                       load_optimizer: bool) -> None:
    try:
        state = layouts.read_saved_state(layout)
    except ckpt.CheckpointError as exc:
        report.error(str(exc))
        return
    saved = state.get("args")
    if saved is None:
        report.warn("the checkpoint stores no 'args': its model shape cannot be checked "
                    "(a run loads it only with --finetune)")
        return
    try:
        ckpt.check_checkpoint_args(saved, ckpt.checkpoint_args_namespace(cfg, 0, 0, 0))
    except ckpt.CheckpointError as exc:
        report.error(f"{layout.directory}: {exc}")
        return
    report.ok(f"model shape matches ({', '.join(ckpt.MODEL_SHAPE_FIELDS[:-1])})")
    saved_dtype = str(getattr(saved, "params_dtype", "")).replace("torch.", "")
    if saved_dtype and saved_dtype != cfg.model.params_dtype:
        report.warn(f"weights were saved as {saved_dtype} and this run trains "
                    f"{cfg.model.params_dtype}: they are cast on load (python "
                    f"{layouts.CONVERTER} --target-params-dtype converts a copy)")
    if not load_optimizer:
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


def check_checkpoint(report: Report, cfg: RunConfig) -> None:
    """--load exists, its tracker names a complete iteration of the format and layout this run
    reads, the files match their checksums and the saved model shape matches; --save can be
    written."""
    report.section("checkpoint")
    c, p = cfg.checkpoint, cfg.parallel
    _check_save_dir(report, c.save)
    if not c.load:
        report.ok("no --load: training starts from randomly initialised weights")
        return
    if not os.path.isdir(c.load):
        if c.save and os.path.abspath(c.save) == os.path.abspath(c.load):
            report.ok(f"--load {c.load} (= --save) does not exist yet: the run starts at "
                      "iteration 0 and later runs resume from it")
        else:
            report.error(f"--load {c.load} does not exist; fix the path (or drop --load)")
        return
    if cfg.deepspeed.universal_checkpoint:
        try:
            tag = layouts.universal_tag(c.load)
        except ckpt.CheckpointError as exc:
            report.error(str(exc))
            return
        report.ok(f"--load {c.load} --universal-checkpoint: tag {tag} (latest_universal), which "
                  "DeepSpeed re-slices for this layout")
        return
    try:
        iteration = ckpt.read_tracker(c.load)
    except ckpt.CheckpointError as exc:
        report.error(str(exc))
        return
    if iteration is None:
        found = ckpt.list_checkpoint_iterations(c.load)
        if found:
            report.error(f"--load {c.load} holds iter_ directories {found[-3:]} but no "
                         f"{ckpt.TRACKER_FILENAME}: write the iteration to resume into it")
        else:
            report.ok(f"--load {c.load} holds no checkpoint yet: the run starts at iteration 0")
        return
    layout = layouts.inspect_directory(ckpt.checkpoint_dir(c.load, iteration))
    if layout is None:
        report.error(f"{ckpt.checkpoint_dir(c.load, iteration)} (named by the tracker) holds no "
                     "Megatron or DeepSpeed checkpoint files")
        return
    report.ok(f"--load {c.load}: iteration {iteration}, {layout.describe()}")
    plan = plan_resume(c, iteration)
    problem = layouts.loadable_problem(
        layout, c.load, deepspeed=cfg.deepspeed.enabled,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        data_parallel_size=p.data_parallel_size, load_optimizer=plan.load_optimizer)
    if problem:
        report.error(problem)
        return
    _verify_checksums(report, layout.model_files + layout.optimizer_files)
    _check_saved_state(report, cfg, layout, plan.load_optimizer)


def _check_save_dir(report: Report, save: Optional[str]) -> None:
    if not save:
        report.note("no --save: no checkpoint will be written")
        return
    existing = os.path.abspath(save)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        report.error(f"--save {save} cannot be written ({existing} is not a writable "
                     "directory); choose another path")
    else:
        report.ok(f"--save {save} is writable")


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


def check_memory(report: Report, cfg: RunConfig, override_gib: Optional[float]) -> None:
    """Per-rank estimate (formulas in app.training.planning.memory) against the device memory, and the
    largest micro-batch that fits."""
    report.section("memory (per rank)")
    total_bytes, desc, device_type = device_memory(override_gib)
    est = estimate_memory(cfg, device_type=device_type)
    buckets = f" + reduce buckets {_gib(est.buffers)}" if est.buffers else ""
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
            "--pipeline-model-parallel-size, or use a DeepSpeed ZeRO stage / optimizer offload")
    report.error(f"estimated {_gib(est.total)} per rank exceeds {FIT_FRACTION:.0%} of {desc}; "
                 f"{fit}: {hint}, or add --checkpoint-activations")


def run_checks(report: Report, cfg: Optional[RunConfig], *, data_path: Sequence[str],
               split: str, data_cache_path: Optional[str], vocab_size: Optional[int],
               device_memory_gib: Optional[float]) -> Report:
    """Every check that can run: the configuration, data, checkpoint and memory sections; with
    `cfg` None (the configuration failed, already reported) only the data files."""
    if cfg is not None:
        report.section("configuration")
        describe_config(report, cfg)
        report.add(*interfaces.describe_choice(cfg.parallel.distributed_backend))
    check_data(report, data_path, split, cfg.model.seq_length if cfg else 1,
               samples_per_split(cfg) if cfg else None, vocab_size, data_cache_path)
    if cfg is not None:
        check_checkpoint(report, cfg)
        check_memory(report, cfg, device_memory_gib)
    return report
