"""A nanoGPT-style GPT-2, torch.compile'd: the throughput reference for pretrain_gpt2.py.

    python bench/nanogpt_reference.py --preset 124M --micro-batch-size 16 --precision bf16
    python bench/nanogpt_reference.py --device cpu --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --vocab-size 512 --no-compile --steps 3

Trained the way nanoGPT's train.py trains it: fp32 weights with autocast to bf16 or fp16 on the
GPU (fp16 through a GradScaler), TF32 matmuls, fused AdamW (decay on matrices only), the whole
model under `torch.compile`; pre-LN blocks with one [q|k|v] projection and
`F.scaled_dot_product_attention(is_causal=True)`, tied embeddings, no dropout, GeLU. One fixed
batch of random tokens (throughput does not depend on the tokens). tokens/s is the median
step's; MFU uses the model FLOPs per token and the peak that pretrain_gpt2.py logs
(app.training.telemetry.flops), so the ratio of the two runs' MFU is the ratio of their tokens/s.
`--json PATH` writes the figures for scripts/gpu_check.sh. bench/bench_train.py times the same
model beside ours in one process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from app.config import ModelConfig
from app.training.telemetry.flops import model_flops_per_token, peak_flops

PRESETS = {  # GPT-2 sizes at seq 1024, vocabulary 50257 padded to 50304 (--preset)
    "124M": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024),
    "350M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024),
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _RefBlock(nn.Module):
    """Pre-LN block with a [q|k|v] projection and SDPA; [b, s, h] -> [b, s, h]."""

    def __init__(self, h: int, heads: int, approximate: str) -> None:
        super().__init__()
        self.heads, self.approximate = heads, approximate
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.attn_out = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.fc_out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=2)  # 3 x [b, s, h]
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, nh, s, hd]
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate=self.approximate))


class RefGPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LN, tied LM head; returns mean CE loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        approximate = "tanh" if cfg.openai_gelu else "none"
        self.wte = nn.Embedding(cfg.padded_vocab_size, h)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, h)
        self.blocks = nn.ModuleList(_RefBlock(h, cfg.num_attention_heads, approximate)
                                    for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(h)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # [b, s, V]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def adamw(model: nn.Module, lr: float = 6e-4, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """nanoGPT's optimizer: AdamW (0.9, 0.95), decay only on >= 2-d tensors, fused if possible."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2],
               "weight_decay": weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)
    except RuntimeError:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=True)


def train_steps(cfg: ModelConfig, micro_batch_size: int, device: torch.device,
                autocast: Optional[torch.dtype], compile_model: bool, warmup: int,
                steps: int) -> dict:
    """Time `warmup + steps` training steps of RefGPT on one random batch [b, s]; the figures
    of the timed steps (median step time, tokens/s, losses, peak CUDA memory)."""
    torch.manual_seed(0)
    model = RefGPT(cfg).to(device).train()
    optimizer = adamw(model)
    step_model = torch.compile(model) if compile_model else model
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.padded_vocab_size, (micro_batch_size, cfg.seq_length + 1),
                           generator=gen)
    ids, labels = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    cuda = device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if autocast == torch.float16 else None
    times: List[float] = []
    losses: List[float] = []
    for i in range(warmup + steps):
        cast = (torch.autocast(device.type, dtype=autocast) if autocast is not None
                else contextlib.nullcontext())
        start = time.perf_counter()
        with cast:
            loss = step_model(ids, labels)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    step_s = statistics.median(times)
    return {"ms_per_step": step_s * 1e3, "tokens_per_s": micro_batch_size * cfg.seq_length / step_s,
            "losses": losses, "params": sum(p.numel() for p in model.parameters()),
            "max_memory_allocated_mb": (torch.cuda.max_memory_allocated(device) / 2 ** 20
                                        if cuda else None)}


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="GPT-2 124M or 350M at seq 1024 (overrides the shape flags)")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=50304, help="padded vocabulary")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--precision", choices=sorted(DTYPES), default="bf16",
                        help="autocast dtype on the GPU (the CPU runs fp32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps (compilation)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    device = torch.device(args.device)
    autocast = DTYPES[args.precision] if device.type == "cuda" else None
    torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT
    torch.backends.cudnn.allow_tf32 = True
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      max_position_embeddings=args.seq_length, padded_vocab_size=args.vocab_size,
                      hidden_dropout=0.0, attention_dropout=0.0)
    result = train_steps(cfg, args.micro_batch_size, device, autocast, args.compile,
                         args.warmup, args.steps)
    peak, peak_source = peak_flops(device, autocast or torch.float32)
    mfu = result["tokens_per_s"] * model_flops_per_token(cfg) / peak
    result.update(model=dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                             num_attention_heads=cfg.num_attention_heads,
                             seq_length=cfg.seq_length, vocab_size=cfg.padded_vocab_size),
                  micro_batch_size=args.micro_batch_size, device=str(device),
                  precision=args.precision if autocast is not None else "fp32",
                  compiled=args.compile, warmup=args.warmup, steps=args.steps,
                  mfu=mfu if mfu == mfu else None, peak_flops=peak, peak_source=peak_source)
    print(f"nanoGPT-style reference ({'compiled' if args.compile else 'eager'}, "
          f"{result['precision']}, {device}): L={cfg.num_layers} h={cfg.hidden_size} "
          f"s={cfg.seq_length} b={args.micro_batch_size}: {result['tokens_per_s']:,.0f} tokens/s, "
          f"{result['ms_per_step']:.1f} ms/step, MFU {100 * mfu:.1f}% of {peak / 1e12:.3f} "
          f"TFLOP/s ({peak_source}); loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
