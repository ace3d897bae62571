"""Training-step throughput of our GPT-2 beside Hugging Face's and a nanoGPT-style reference.

One process, fp32, dropout 0, the same shapes, data and optimizer (AdamW, decay off for biases
and LayerNorm, torch's fused implementation where supported) for every implementation. A step is
forward + loss + backward + optimizer step (+ LR schedule for ours). Steps are interleaved across
implementations (and the order rotated every step) so that load from other processes on the
machine affects all of them alike. MFU = model FLOP/s (app.training.telemetry.flops.model_flops_per_token) over
this machine's measured fp32 matmul peak.

    python bench/bench_train.py                 # 3 warm-up + 10 timed steps each
    python bench/bench_train.py --steps 20 --impls ours,hf

GPU mode (--device cuda): GPT-2 124M or 350M at seq 1024 (--preset), bf16 or fp16 autocast over
fp32 weights (--precision; fp16 with a GradScaler), MFU over the GPU's measured matmul peak in
that dtype. Besides the references it times our model three ways: "ours" (the default, fastest
selection: every fusion on, SDPA for causal attention), "ours-nofuse" (every --no-*-fusion
flag; SDPA still) and "ours-eager" (nothing fused: q k^T + PyTorch softmax + @ v), and with
every fusion on but one ("ours-no-masked-softmax", "ours-no-bias-gelu", "ours-no-bias-dropout",
"ours-no-layernorm", "ours-no-cross-entropy-loss"), and with each transformer layer compiled
("ours-compiled": --compile-layers, the fusion flags as in "ours"; its compilation happens in
the untimed warm-up). The nanoGPT-style reference ("nano") is
bench/nanogpt_reference.py's model, here uncompiled. --json PATH writes the figures too:

    python bench/bench_train.py --device cuda --preset 124M --precision bf16 \
        --impls ours,ours-nofuse,ours-eager,nano --micro-batch-size 8 --steps 20
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn


# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config import ModelConfig, OptimizerConfig
from app.training.telemetry.flops import model_flops_per_token
from app.model import GPT2Model, fused
from app.model.gpt2 import compile_transformer_layers
from app.optim import OptimizerParamScheduler, build_optimizer
from common import (PeakResult, format_table, keep_freed_memory, measure_matmul_peak,
                    summarize)
from nanogpt_reference import RefGPT

PRESETS = {  # GPT-2 sizes at seq 1024 (--preset)
    "124M": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
                 vocab_size=50304),
    "350M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                 vocab_size=50304),
}
OPT = OptimizerConfig(lr=1e-4, min_lr=1e-5, lr_decay_style="cosine", lr_decay_iters=1000,
                      lr_warmup_iters=0, weight_decay=0.01)


# ---- one training step per implementation -------------------------------------------------------
def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The references' optimizer: AdamW, decay only on >= 2-d tensors, fused where supported."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": OPT.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=OPT.lr, betas=(OPT.adam_beta1, OPT.adam_beta2), eps=OPT.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except RuntimeError:
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


class Impl:
    """A model, its optimizer and a loss function; `step()` times forward, backward, optimizer.

    On a GPU the forward runs under `autocast` (bf16/fp16; None: fp32), fp16 through a
    GradScaler, and each phase is closed by a device synchronisation so its time is honest.
    """

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[], torch.Tensor],
                 after_step: Callable[[], None] = lambda: None,
                 autocast: Optional[torch.dtype] = None) -> None:
        self.name, self.model, self.optimizer = name, model, optimizer
        self.loss_fn, self.after_step = loss_fn, after_step
        self.device = next(model.parameters()).device
        self.autocast = autocast
        self.scaler = (torch.amp.GradScaler("cuda") if autocast == torch.float16 else None)
        self.phases: Dict[str, List[float]] = {"fwd": [], "bwd": [], "opt": [], "step": [],
                                               "cpu": []}
        self.losses: List[float] = []
        self.selections: Dict[str, tuple] = {}  # fused-op choices seen in its steps

    def step(self, record: bool) -> None:
        """One training step; wall time per phase and process CPU time go to `phases`."""
        sync = (torch.cuda.synchronize if self.device.type == "cuda" else lambda: None)
        cast = (torch.autocast("cuda", dtype=self.autocast) if self.autocast is not None
                else contextlib.nullcontext())
        c0 = time.process_time()
        t0 = time.perf_counter()
        with cast:
            loss = self.loss_fn()
        sync()
        t1 = time.perf_counter()
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        sync()
        t2 = time.perf_counter()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.after_step()
        sync()
        t3 = time.perf_counter()
        c3 = time.process_time()
        self.losses.append(loss.item())
        if record:
            for key, value in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2),
                               ("step", t3 - t0), ("cpu", c3 - c0)):
                self.phases[key].append(value)


NO_FUSION = dict(masked_softmax_fusion=False, bias_gelu_fusion=False, bias_dropout_fusion=False,
                 layernorm_fusion=False, cross_entropy_loss_fusion=False)
OUR_VARIANTS = {"ours": {}, "ours-nofuse": NO_FUSION,
                "ours-eager": dict(NO_FUSION, attention_backend="local"),
                # every fusion on but one: "ours-no-layernorm", "ours-no-cross-entropy-loss", ...
                **{"ours-no-" + key[:-len("_fusion")].replace("_", "-"): {key: False}
                   for key in NO_FUSION},
                "ours-compiled": {}}
COMPILED_VARIANTS = ("ours-compiled",)
"""Variants whose transformer layers are compiled (app.model.gpt2.compile_transformer_layers)."""


def _ours(name: str, cfg: ModelConfig, ids: torch.Tensor, labels: torch.Tensor,
          autocast: Optional[torch.dtype]) -> Impl:
    """Our GPT-2 with the fusion settings of OUR_VARIANTS[name], on the device of `ids`."""
    model = GPT2Model(dataclasses.replace(cfg, **OUR_VARIANTS[name])).to(ids.device).train()
    if name in COMPILED_VARIANTS:
        compile_transformer_layers(model)
    opt = build_optimizer(model, OPT)
    sched = OptimizerParamScheduler(opt, OPT)
    pos = torch.arange(cfg.seq_length, device=ids.device).unsqueeze(0).expand_as(ids)
    return Impl(name, model, opt, lambda: model(ids, pos, None, labels).mean(),
                lambda: sched.step(), autocast)


def build_impls(cfg: ModelConfig, names: List[str], ids: torch.Tensor,
                labels: torch.Tensor, autocast: Optional[torch.dtype] = None) -> List[Impl]:
    """The requested implementations, all fed the same ids [b, s] and labels [b, s] (their
    device is the benchmark's)."""
    impls = [_ours(name, cfg, ids, labels, autocast) for name in OUR_VARIANTS if name in names]
    device = ids.device
    if "hf" in names:
        import transformers
        hf_cfg = transformers.GPT2Config(
            n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
            n_positions=cfg.max_position_embeddings, vocab_size=cfg.padded_vocab_size,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
            activation_function="gelu_pytorch_tanh" if cfg.openai_gelu else "gelu")
        hf = transformers.GPT2LMHeadModel(hf_cfg).to(device).train()
        vocab = cfg.padded_vocab_size
        impls.append(Impl("hf", hf, _adamw(hf), lambda: F.cross_entropy(
            hf(input_ids=ids).logits.view(-1, vocab), labels.reshape(-1)), autocast=autocast))
    if "nano" in names:
        ref = RefGPT(cfg).to(device).train()
        impls.append(Impl("nano", ref, _adamw(ref), lambda: ref(ids, labels), autocast=autocast))
    return impls


def run(impls: List[Impl], warmup: int, steps: int) -> None:
    """warmup + steps rounds; each round runs every implementation once, order rotated."""
    for i in range(warmup + steps):
        shift = i % len(impls)
        for impl in impls[shift:] + impls[:shift]:
            fused.reset_selections()
            impl.step(record=i >= warmup)
            impl.selections = fused.selections()


def _paired_speed(impl: Impl, ref: Impl) -> float:
    """Median over rounds of ref_step / impl_step: each round's runs are adjacent in time, so
    slow drifts of the machine's load cancel in the ratio."""
    ratios = [r / m for m, r in zip(impl.phases["step"], ref.phases["step"])]
    return summarize(ratios)["median"]


def figures(impls: List[Impl], cfg: ModelConfig, tokens_per_step: int,
            peak: float) -> List[Dict[str, object]]:
    """Per implementation: tokens/s and MFU (median step), ms/step (median, best, p90), phase
    medians, CPU ms/step, speed relative to the fastest reference (paired per round) and by CPU
    time (reference names in `speed_vs`, `cpu_speed_vs`), first loss, parameter count."""
    flops_per_token = model_flops_per_token(cfg)
    med = {i.name: {k: summarize(v)["median"] for k, v in i.phases.items()} for i in impls}
    by_name = {i.name: i for i in impls}
    refs = [n for n in med if not n.startswith("ours")]
    best = min(refs, key=lambda n: med[n]["step"]) if refs else None
    best_cpu = min(refs, key=lambda n: med[n]["cpu"]) if refs else None
    out = []
    for impl in impls:
        m, times = med[impl.name], summarize(impl.phases["step"])
        tok_s = tokens_per_step / m["step"]
        out.append({
            "impl": impl.name, "tokens_per_s": tok_s, "ms_step": m["step"] * 1e3,
            "ms_best": times["min"] * 1e3, "ms_p90": times["p90"] * 1e3,
            "ms_fwd": m["fwd"] * 1e3, "ms_bwd": m["bwd"] * 1e3, "ms_opt": m["opt"] * 1e3,
            "cpu_ms": m["cpu"] * 1e3, "speed_vs": best, "cpu_speed_vs": best_cpu,
            "speed": _paired_speed(impl, by_name[best]) if best else float("nan"),
            "cpu_speed": med[best_cpu]["cpu"] / m["cpu"] if best_cpu else float("nan"),
            "mfu": tok_s * flops_per_token / peak,
            "mfu_best": tokens_per_step / times["min"] * flops_per_token / peak,
            "loss0": impl.losses[0], "params": sum(p.numel() for p in impl.model.parameters())})
    return out


def report(rows: List[Dict[str, object]]) -> str:
    """The figures() rows as a text table."""
    best, best_cpu = rows[0]["speed_vs"], rows[0]["cpu_speed_vs"]
    cells = [[r["impl"], f"{r['tokens_per_s']:,.0f}", f"{r['ms_step']:.0f}", f"{r['ms_best']:.0f}",
              f"{r['ms_p90']:.0f}", f"{r['ms_fwd']:.0f}/{r['ms_bwd']:.0f}/{r['ms_opt']:.0f}",
              f"{r['cpu_ms']:.0f}", f"{r['speed']:.3f}", f"{r['cpu_speed']:.3f}",
              f"{100 * r['mfu']:.1f}%", f"{100 * r['mfu_best']:.1f}%", f"{r['loss0']:.3f}",
              f"{r['params']:,}"] for r in rows]
    header = ["impl", "tokens/s", "ms/step", "best ms", "p90 ms", "fwd/bwd/opt ms", "cpu ms",
              f"speed vs {best}", f"cpu-speed vs {best_cpu}", "MFU", "MFU best", "loss@0",
              "params"]
    return format_table(header, cells)


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps")
    parser.add_argument("--impls", default="ours,hf,nano",
                        help="comma list of hf, nano, " + ", ".join(OUR_VARIANTS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="GPT-2 124M or 350M at seq 1024 (overrides the shape flags)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="bf16/fp16: autocast over fp32 weights (GPU only)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-attention-heads", type=int, default=6)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--openai-gelu", action="store_true", help="tanh GeLU in every model")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="the peak FLOP/s for MFU, instead of measuring the matmul peak")
    parser.add_argument("--json", default=None,
                        help="also write the figures (and the run's settings) to this file")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc malloc as is (default: keep freed memory for reuse, "
                             "for every implementation alike; see bench.common.keep_freed_memory)")
    args = parser.parse_args(argv)
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    device = torch.device(args.device)
    autocast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    if autocast is not None and device.type != "cuda":
        raise SystemExit("--precision bf16/fp16 needs --device cuda")
    torch.set_num_threads(args.threads)
    kept = False if args.default_malloc else keep_freed_memory()
    print(f"malloc keeps freed memory: {kept}")
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      max_position_embeddings=args.seq_length, padded_vocab_size=args.vocab_size,
                      hidden_dropout=0.0, attention_dropout=0.0, openai_gelu=args.openai_gelu)
    def measure_peak():
        if args.peak_flops:
            return PeakResult(flops=args.peak_flops, best_n=0, by_n={0: args.peak_flops})
        if device.type == "cuda":
            return measure_matmul_peak((2048, 4096, 8192), dtype=autocast or torch.float32,
                                       device=device)
        return measure_matmul_peak()

    peak = measure_peak()
    sizes = ", ".join(f"{n}: {f / 1e9:.1f}" for n, f in peak.by_n.items())
    print(f"device {device}, threads={args.threads}  {args.precision} matmul peak "
          f"{peak.flops / 1e9:.1f} GFLOP/s (n={peak.best_n}; {sizes})")
    print(f"config L={cfg.num_layers} h={cfg.hidden_size} heads={cfg.num_attention_heads} "
          f"s={cfg.seq_length} V={cfg.padded_vocab_size} b={args.micro_batch_size}; "
          f"{model_flops_per_token(cfg) / 1e6:.1f} MFLOP/token; "
          f"ln(V)={math.log(cfg.padded_vocab_size):.3f}")
    gen = torch.Generator().manual_seed(1)
    shape = (args.micro_batch_size, args.seq_length + 1)
    tokens = torch.randint(0, args.vocab_size, shape, generator=gen)
    ids, labels = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    impls = build_impls(cfg, args.impls.split(","), ids, labels, autocast)
    run(impls, args.warmup, args.steps)
    for impl in impls:
        for op, (implementation, why) in sorted(impl.selections.items()):
            print(f"  {impl.name}: {op}: {implementation} ({why})")
    again = measure_peak()  # the machine is shared: keep the better of two measurements
    if again.flops > peak.flops:
        print(f"matmul peak re-measured after the run: {again.flops / 1e9:.1f} GFLOP/s (used)")
        peak = again
    print(f"{args.warmup} warm-up + {args.steps} timed steps each, interleaved. tokens/s, ms/step "
          "and MFU: median step; 'speed': median over rounds of (reference ms / this ms); "
          "'cpu ms': process CPU time per step (less sensitive to other processes)")
    rows = figures(impls, cfg, ids.numel(), peak.flops)
    print(report(rows))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB")
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2 ** 30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "precision": args.precision,
                       "micro_batch_size": args.micro_batch_size, "steps": args.steps,
                       "model": dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                     seq_length=cfg.seq_length, vocab_size=cfg.padded_vocab_size),
                       "peak_flops": peak.flops, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
