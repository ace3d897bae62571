"""Activation memory per rank with and without sequence parallelism and each recompute setting.

    python bench/bench_memory.py [--layers 4 --hidden 512 --heads 8 --seq 512 --micro-batch 2]

What is measured: the bytes of the tensors autograd keeps for backward ("saved activations"),
per rank, during the forward and backward of one micro-batch of the model (fp32, dropout 0.1 as
in training, so the attention probabilities and dropout masks are materialised as in
Megatron's accounting). A `torch.autograd.graph.saved_tensors_hooks` pair sees every tensor
saved for backward, including those saved while recompute reruns a forward inside backward;
each is counted once per storage (a view holds its whole storage), parameters are excluded,
and a storage stops counting when autograd drops the last saved reference to it. Two figures:

- after forward: what is held between the forward and the backward (what recompute and
  sequence parallelism shrink);
- peak: the most held at any moment of forward + backward (after forward, plus what a
  recomputed chunk saves while its backward runs).

Not counted: parameters, gradients, optimizer states, and temporaries that autograd does not
keep (they are freed within the op). The vocabulary is small (1024) so the logits do not hide
the transformer layers. Every setting runs the same model and batch; the TP=2 settings run on
2 gloo ranks in one spawn and report rank 0 (the ranks hold the same amounts).

The reference column is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), per layer, converted to fp32 (x2): s b h (34 + 5 a s / h) without
parallelism; s b h (10 + 24/t + 5 a s / (h t)) with TP t; s b h / t (34 + 5 a s / h) with TP
and SP; selective recompute drops the 5 a s / h term; full recompute keeps 2 s b h (the
layer input; / t with SP).
"""
from __future__ import annotations

import argparse
import os
import sys
import weakref
from typing import Dict, List, Tuple

import torch

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RAW_VOCAB = 1000


class SavedActivationMeter:
    """saved_tensors_hooks that track the live bytes of tensors autograd saves for backward."""

    def __init__(self, exclude: List[torch.Tensor]) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.refs: Dict[int, List[int]] = {}  # storage -> [saved references, bytes]
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.refs[key]

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return tensor
        entry = self.refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        box = _Saved(tensor)
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def measure(settings: List[Tuple[str, List[str]]], model_argv: List[str]) -> Dict[str, Tuple[int, int]]:
    """On every rank: {setting: (bytes after forward, peak bytes)} for one micro-batch."""
    import torch.distributed as dist

    import arguments
    from tests.harness.synthetic import build_synthetic_run
    from app.training.loss import masked_mean_loss

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    for name, flags in settings:
        cfg = arguments.config_from_argv(model_argv + flags, world, RAW_VOCAB)
        run = build_synthetic_run(cfg, 8)
        model, trainer = run["model"], run["trainer"]
        batch = trainer.batches.next(run["iterator"])
        model.train()
        meter = SavedActivationMeter(list(model.parameters()))
        with meter.hooks():
            loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                         labels=batch["labels"])
            loss = masked_mean_loss(loss, batch["loss_mask"])
            after_forward = meter.current
            loss.backward()
        out[name] = (after_forward, meter.peak)
    return out


def korthikanti_bytes(setting: str, s: int, b: int, h: int, a: int, layers: int,
                      t: int) -> float:
    """The paper's per-layer activation bytes (fp16 figures x 2 for fp32) times the layers."""
    sbh = s * b * h
    sp, selective = "SP" in setting, "selective" in setting
    if "full" in setting:
        per_layer = 2 * sbh / (t if sp else 1)
    else:
        attn = 0 if selective else 5 * a * s / h
        if t == 1:
            per_layer = sbh * (34 + attn)
        elif sp:
            per_layer = sbh / t * (34 + attn)
        else:
            per_layer = sbh * (10 + 24 / t + attn / t)
    return 2 * per_layer * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    a = parser.parse_args()
    model_argv = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
                  "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
                  "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.micro_batch),
                  "--train-iters", "1", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                  "--make-vocab-size-divisible-by", "512", "--peak-flops", "1e12",
                  "--distributed-backend", "gloo"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    sp = ["--sequence-parallel"]
    sel = ["--recompute-granularity", "selective"]
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
    block = ["--recompute-granularity", "full", "--recompute-method", "block",
             "--recompute-num-layers", str(a.layers // 2)]
    one = [("TP1", []), ("TP1 selective", sel), ("TP1 full", full)]
    two = [("TP2", tp2), ("TP2 SP", tp2 + sp), ("TP2 selective", tp2 + sel),
           ("TP2 SP selective", tp2 + sp + sel), ("TP2 full", tp2 + full),
           ("TP2 SP full", tp2 + sp + full), (f"TP2 SP full block {a.layers // 2}", tp2 + sp + block)]
    from tests.harness.distributed import run_distributed
    results = dict(measure(one, model_argv))
    results.update(run_distributed(measure, 2, two, model_argv, timeout=3600)[0])
    mib = 2.0 ** 20
    base = results["TP2"][0]
    print(f"saved activations per rank, one micro-batch: L={a.layers} h={a.hidden} "
          f"heads={a.heads} s={a.seq} b={a.micro_batch} fp32, dropout 0.1, vocab 1024")
    print(f"{'setting':<26}{'after fwd MiB':>14}{'peak MiB':>10}{'vs TP2':>8}"
          f"{'paper MiB':>11}")
    for name, (after, peak) in results.items():
        t = 2 if name.startswith("TP2") else 1
        paper = korthikanti_bytes(name, a.seq, a.micro_batch, a.hidden, a.heads, a.layers, t)
        if "block" in name:
            paper = (korthikanti_bytes("TP2 SP", a.seq, a.micro_batch, a.hidden, a.heads,
                                       a.layers - a.layers // 2, 2)
                     + korthikanti_bytes("TP2 SP full", a.seq, a.micro_batch, a.hidden,
                                         a.heads, a.layers // 2, 2))
        print(f"{name:<26}{after / mib:>14.1f}{peak / mib:>10.1f}{after / base:>8.2f}"
              f"{paper / mib:>11.1f}")


if __name__ == "__main__":
    main()
