"""Forward+backward time of each fused op, per implementation, at GPT-2 124M / 350M shapes.

For every op: the csrc/ kernel (or the torch.compile'd fusion), PyTorch eager (the fallback) and
torch.compile of the eager code, timed in the same run, with the achieved memory bandwidth
(the op's minimal traffic: every input read once, every output written once, forward and
backward) and the speed-up over eager. Causal attention is also timed whole: q k^T + fused
softmax + @ v against SDPA's flash and memory-efficient backends - the measurement behind the
default `--attention-backend auto` (docs/kernels.md).

    python bench/bench_kernels.py                          # GPU: 124M and 350M, bf16
    python bench/bench_kernels.py --dtype fp16 --models 350M --micro-batch 4
    python bench/bench_kernels.py --device cpu --models tiny --no-compile   # CPU smoke run

Before timing, every implementation's output and input gradients are checked against eager
PyTorch on the same inputs (`max_rel_err`: the largest |x - eager| / max|eager| over the output
and the gradients; ops that draw a dropout mask are not compared). --json PATH also writes
every timing (ms, GB/s, speed-up over eager) and error per model; several --dtype values run
one after the other in one process.

Without CUDA the kernel rows are skipped (reported as unavailable) and only eager/compiled
PyTorch run; no figure from such a run says anything about a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.kernels import library, ops
from app.model import fused
from app.mpu.cross_entropy import fused_vocab_parallel_cross_entropy
from app.mpu.parallel_state import ParallelState
from common import format_table, synchronize

MODELS = {  # name: (hidden, heads, seq, vocab)
    "tiny": (64, 4, 128, 512),
    "124M": (768, 12, 1024, 50304),
    "350M": (1024, 16, 1024, 50304),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    """One op at one shape: a builder per implementation, and the op's minimal traffic."""

    op: str
    shape: str
    bytes_moved: int
    impls: Dict[str, Callable[[], Optional[Callable[[], Outputs]]]]  # name -> (None: unavailable)
    random: bool = False
    """The op draws a dropout mask: implementations cannot be compared value for value."""


def _time(step: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of one step (CUDA events on a GPU)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


Outputs = List[Optional[torch.Tensor]]
"""What one step computed: its output, then each input's gradient."""


def _fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
             grad: Optional[torch.Tensor] = None) -> Callable[[], Outputs]:
    """A step running fn(*inputs) and its backward (inputs that require grad get gradients);
    it returns the output and the gradients."""
    def step() -> Outputs:
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(grad if grad is not None else torch.ones_like(out))
        return [out.detach()] + [t.grad for t in inputs]
    return step


def max_relative_error(got: Outputs, want: Outputs) -> float:
    """Largest |got - want| / max|want| over the tensors of two steps' outputs (fp32)."""
    worst = 0.0
    for a, b in zip(got, want):
        if a is None or b is None:
            continue
        a, b = a.float(), b.float()
        scale = b.abs().max().item() or 1.0
        worst = max(worst, (a - b).abs().max().item() / scale)
    return worst


def _kernel_ok(device: torch.device) -> bool:
    return device.type == "cuda" and library.status().available


def _compiled(fn: Callable, enabled: bool) -> Optional[Callable]:
    return torch.compile(fn, fullgraph=True) if enabled else None


def _rand(*shape, device, dtype, requires_grad=True):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(requires_grad)


def softmax_cases(b: int, heads: int, s: int, dtype, device, compile_: bool) -> List[Case]:
    size = torch.finfo(dtype).bits // 8
    numel = b * heads * s * s
    scale = 1.0 / 8.0
    x = _rand(b, heads, s, s, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    causal = fused.causal_mask(s, s, device)
    # --reset-attention-mask style: two documents per sample, causal within each
    doc = torch.arange(s, device=device) >= s // 3
    mask = (causal | (doc.view(-1, 1) != doc.view(1, -1))).view(1, 1, s, s).expand(b, 1, s, s)
    mask = mask.contiguous()
    kernel = _kernel_ok(device)

    def eager_causal(t):
        return fused._softmax_reference(t, causal, scale, True)

    def eager_masked(t):
        return fused._softmax_reference(t, mask, scale, True)

    traffic = 5 * numel * size  # fwd: read x, write y; bwd: read dy, y, write dx
    shape = f"[{b},{heads},{s},{s}]"
    cc, cm = _compiled(eager_causal, compile_), _compiled(eager_masked, compile_)
    return [
        Case("causal softmax", shape, traffic, {
            "kernel": lambda: kernel and _fwd_bwd(lambda t: ops.causal_softmax(t, scale), [x], dy),
            "eager": lambda: _fwd_bwd(eager_causal, [x], dy),
            "compile": lambda: cc and _fwd_bwd(cc, [x], dy)}),
        Case("masked softmax", shape, traffic + 2 * b * s * s, {
            "kernel": lambda: kernel and _fwd_bwd(lambda t: ops.masked_softmax(t, mask, scale),
                                                  [x], dy),
            "eager": lambda: _fwd_bwd(eager_masked, [x], dy),
            "compile": lambda: cm and _fwd_bwd(cm, [x], dy)}),
    ]


def attention_case(b: int, heads: int, s: int, hidden: int, dtype, device,
                   compile_: bool) -> Case:
    d = hidden // heads
    q, k, v = (_rand(b, heads, s, d, device=device, dtype=dtype) for _ in range(3))
    dy = torch.randn_like(q)
    kernel = _kernel_ok(device)

    def local(softmax_kernel: bool):
        return lambda q_, k_, v_: fused.attention(q_, k_, v_, None, 0.0, "local", softmax_kernel)

    def sdpa(backend):
        def run(q_, k_, v_):
            from torch.nn.attention import sdpa_kernel
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        return run

    from torch.nn.attention import SDPBackend
    cuda = device.type == "cuda"
    compiled_local = _compiled(local(False), compile_)
    # traffic of the unfused path's score matrices is the point; report q, k, v, out, grads
    traffic = 8 * b * heads * s * d * (torch.finfo(dtype).bits // 8)
    return Case("causal attention", f"[{b},{heads},{s},{d}]", traffic, {
        "local+kernel": lambda: kernel and _fwd_bwd(local(True), [q, k, v], dy),
        "local eager": lambda: _fwd_bwd(local(False), [q, k, v], dy),
        "local compile": lambda: compiled_local and _fwd_bwd(compiled_local, [q, k, v], dy),
        "SDPA flash": lambda: cuda and dtype != torch.float32 and _fwd_bwd(
            sdpa(SDPBackend.FLASH_ATTENTION), [q, k, v], dy),
        "SDPA efficient": lambda: cuda and _fwd_bwd(sdpa(SDPBackend.EFFICIENT_ATTENTION),
                                                    [q, k, v], dy)})


def layer_norm_cases(rows: int, hidden: int, dtype, device, compile_: bool) -> List[Case]:
    cases = []
    kernel = _kernel_ok(device)
    size = torch.finfo(dtype).bits // 8
    for pdtype in ([dtype, torch.float32] if dtype != torch.float32 else [dtype]):
        x = _rand(rows, hidden, device=device, dtype=dtype)
        w = torch.ones(hidden, device=device, dtype=pdtype, requires_grad=True)
        bias = torch.zeros(hidden, device=device, dtype=pdtype, requires_grad=True)
        dy = torch.randn_like(x)

        def eager(x_, w_, b_):
            return fused.layer_norm(x_, w_, b_, 1e-5, use_kernel=False)

        compiled = _compiled(eager, compile_)
        traffic = 5 * rows * hidden * size  # x, y, dy, x again, dx (params are small)
        label = "layer norm" + (" (fp32 params)" if pdtype != dtype else "")
        cases.append(Case(label, f"[{rows},{hidden}]", traffic, {
            "kernel": lambda x=x, w=w, bias=bias, dy=dy: kernel and _fwd_bwd(
                lambda a, b_, c: ops.layer_norm(a, b_, c, 1e-5), [x, w, bias], dy),
            "eager": lambda x=x, w=w, bias=bias, dy=dy, f=eager: _fwd_bwd(f, [x, w, bias], dy),
            "compile": lambda x=x, w=w, bias=bias, dy=dy, f=compiled: f and _fwd_bwd(
                f, [x, w, bias], dy)}))
    return cases


def cross_entropy_case(rows: int, vocab: int, dtype, device, compile_: bool) -> Case:
    logits = _rand(rows, vocab, device=device, dtype=dtype)
    target = torch.randint(0, vocab, (rows,), device=device)
    kernel = _kernel_ok(device)
    single = ParallelState.single()

    def eager(z):
        return F.cross_entropy(z.float(), target, reduction="none")

    def fused_kernel(z):
        return fused_vocab_parallel_cross_entropy(z, target, single, ops.cross_entropy_stats,
                                                  ops.cross_entropy_grad)

    compiled = _compiled(eager, compile_)
    traffic = 3 * rows * vocab * (torch.finfo(dtype).bits // 8)  # read z (fwd, bwd), write dz
    return Case("cross entropy", f"[{rows},{vocab}]", traffic, {
        "kernel": lambda: kernel and _fwd_bwd(fused_kernel, [logits]),
        "eager": lambda: _fwd_bwd(eager, [logits]),
        "compile": lambda: compiled and _fwd_bwd(compiled, [logits])})


def elementwise_cases(rows: int, hidden: int, dtype, device, compile_: bool) -> List[Case]:
    size = torch.finfo(dtype).bits // 8
    x4 = _rand(rows, 4 * hidden, device=device, dtype=dtype)
    b4 = _rand(4 * hidden, device=device, dtype=dtype)
    x, bias, res = (_rand(rows, hidden, device=device, dtype=dtype),
                    _rand(hidden, device=device, dtype=dtype),
                    _rand(rows, hidden, device=device, dtype=dtype))
    p = 0.1

    def gelu_eager(b_, x_):
        return F.gelu(x_ + b_, approximate="tanh")

    def bda_eager(x_, b_, r_):
        return r_ + F.dropout(x_ + b_, p, True)

    def bda_fused(x_, b_, r_):
        keep = torch.empty_like(x_, dtype=torch.bool).bernoulli_(1 - p)
        return fused._bias_dropout_add(x_, b_, r_, keep, 1 / (1 - p))

    gelu_c = _compiled(gelu_eager, compile_)
    bda_c = _compiled(fused._bias_dropout_add, compile_)
    return [
        Case("bias+gelu", f"[{rows},{4 * hidden}]", 4 * rows * 4 * hidden * size, {
            "eager": lambda: _fwd_bwd(gelu_eager, [b4, x4]),
            "compile": lambda: gelu_c and _fwd_bwd(gelu_c, [b4, x4])}),
        Case("bias+dropout+add", f"[{rows},{hidden}]", 6 * rows * hidden * size, {
            "eager": lambda: _fwd_bwd(bda_eager, [x, bias, res]),
            "compile": lambda: bda_c and _fwd_bwd(
                lambda x_, b_, r_: bda_c(x_, b_, r_, torch.empty_like(
                    x_, dtype=torch.bool).bernoulli_(1 - p), 1 / (1 - p)), [x, bias, res]),
            "mask + eager math": lambda: _fwd_bwd(bda_fused, [x, bias, res])}, random=True),
    ]


def run_cases(cases: List[Case], device: torch.device, warmup: int,
              iters: int) -> List[Dict[str, object]]:
    """One record per op and implementation: ms (None: unavailable here), GB/s of the op's
    minimal traffic, the speed-up over eager PyTorch and the largest relative error against
    it (None for the reference itself and for ops that draw a dropout mask)."""
    records: List[Dict[str, object]] = []
    for case in cases:
        results: Dict[str, Optional[float]] = {}
        outputs: Dict[str, Outputs] = {}
        for name, make in case.impls.items():
            step = make()
            if step:
                outputs[name] = [t.clone() for t in step() if t is not None]
                results[name] = _time(step, device, warmup, iters)
            else:
                results[name] = None
        base_name = "eager" if "eager" in results else "local eager"
        base = results.get(base_name)
        for name, seconds in results.items():
            error = (None if case.random or name == base_name or name not in outputs
                     else max_relative_error(outputs[name], outputs[base_name]))
            records.append({"op": case.op, "shape": case.shape, "implementation": name,
                            "ms": seconds * 1e3 if seconds else None,
                            "gb_s": case.bytes_moved / seconds / 1e9 if seconds else None,
                            "vs_eager": base / seconds if seconds and base else None,
                            "max_rel_err": error})
    return records


def _table_rows(records: List[Dict[str, object]]) -> List[list]:
    return [[r["op"], r["shape"], r["implementation"], "n/a", "", "", ""] if r["ms"] is None else
            [r["op"], r["shape"], r["implementation"], f"{r['ms']:.3f}", f"{r['gb_s']:.0f}",
             f"{r['vs_eager']:.2f}x" if r["vs_eager"] else "",
             "" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}"] for r in records]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["124M", "350M"], choices=list(MODELS))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile columns")
    parser.add_argument("--json", default=None, help="also write every timing to this file")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu" and dtype == torch.float16:
        raise SystemExit("--dtype fp16 needs a GPU; use bf16 or fp32 on the CPU")
    status = library.status() if device.type == "cuda" else library.Status(False, "CPU run")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {device} ({name}), torch {torch.__version__}, dtype {args.dtype}, kernels: "
          f"{'loaded' if status.available else 'unavailable (' + status.reason + ')'}")
    by_model: Dict[str, List[Dict[str, object]]] = {}
    for model in args.models:
        hidden, heads, seq, vocab = MODELS[model]
        b = args.micro_batch
        rows = b * seq
        cases = softmax_cases(b, heads, seq, dtype, device, args.compile)
        cases.append(attention_case(b, heads, seq, hidden, dtype, device, args.compile))
        cases += layer_norm_cases(rows, hidden, dtype, device, args.compile)
        cases.append(cross_entropy_case(rows, vocab, dtype, device, args.compile))
        cases += elementwise_cases(rows, hidden, dtype, device, args.compile)
        by_model[model] = run_cases(cases, device, args.warmup, args.iters)
        print(f"\nGPT-2 {model} shapes (micro-batch {b}, seq {seq}, hidden {hidden}, "
              f"heads {heads}, vocab {vocab}): forward+backward")
        print(format_table(["op", "shape", "implementation", "ms", "GB/s", "vs eager",
                            "max rel err"],
                           _table_rows(by_model[model])))
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "device_name": name, "torch": torch.__version__,
                       "dtype": args.dtype, "micro_batch": args.micro_batch,
                       "kernels": status.available, "kernels_reason": status.reason,
                       "models": by_model}, f, indent=1)


if __name__ == "__main__":
    main()
