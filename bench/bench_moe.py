"""Training-step throughput of our MoE model beside Megatron Core's own MoE GPTModel, and beside
our dense model of the same active FLOPs.

One process, the same shape, data, threads and optimizer (torch's AdamW) for every model; a
step is forward + loss + backward + optimizer step. Steps are interleaved across the models
(the order rotated every step) so that other load on the machine affects all of them alike.

- "ours": a Qwen3-MoE-shaped GPT2Model (SwiGLU, RMSNorm, no biases, RoPE, GQA, QK-norm), E
  experts top-k of width F, aux loss 1e-2, the allgather dispatcher, the experts as a loop
  ("ours-grouped": --moe-grouped-gemm, torch's grouped_mm where the shapes allow it;
  "ours-alltoall": the alltoall dispatcher);
- "mcore": megatron-core 0.16.1's GPTModel with the same TransformerConfig fields, local spec
  (SequentialMLP, the allgather dispatcher, torch RMSNorm), built and run with the CPU stand-ins
  of docs/moe.md (torch.cuda.current_device -> "cpu", moe_utils.te_general_gemm = None, the RNG
  tracker's fork a no-op with dropout 0); its arithmetic untouched;
- "dense": our Llama-recipe model whose SwiGLU width is k x F (the active FLOPs of the MoE model,
  router aside).

    python bench/bench_moe.py                      # 2 warm-up + 8 timed steps each
    python bench/bench_moe.py --steps 12 --models ours,mcore --threads 2 --json out.json

Tokens/s = micro-batch x sequence / median step time (wall clock), and per CPU-second (the
process's CPU time: on a machine shared with other work, what the step itself costs). Goals
(the MoE issue): ours >= 1.0x mcore, ours >= 0.7x dense.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config import ModelConfig, MoEConfig  # noqa: E402
from app.model import GPT2Model  # noqa: E402
from app.model.moe import begin_iteration  # noqa: E402
from app.training.telemetry.flops import model_flops_per_token  # noqa: E402
from common import format_table, summarize  # noqa: E402


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--layers", type=int, default=4)
    add("--hidden", type=int, default=256)
    add("--heads", type=int, default=8)
    add("--query-groups", type=int, default=4)
    add("--experts", type=int, default=8)
    add("--topk", type=int, default=2)
    add("--moe-ffn", type=int, default=256)
    add("--seq", type=int, default=256)
    add("--micro-batch", type=int, default=4)
    add("--vocab", type=int, default=4096)
    add("--warmup", type=int, default=2)
    add("--steps", type=int, default=8)
    add("--threads", type=int, default=torch.get_num_threads())
    add("--models", default="ours,ours-grouped,ours-alltoall,mcore,dense")
    add("--json", default=None, help="also write the figures to this file")
    return parser.parse_args()


def _our_config(o: argparse.Namespace, dense: bool = False, **moe) -> ModelConfig:
    return ModelConfig(
        num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads,
        seq_length=o.seq, padded_vocab_size=o.vocab, swiglu=True, normalization="RMSNorm",
        add_bias_linear=False, position_embedding_type="rope", group_query_attention=True,
        num_query_groups=o.query_groups, qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=0.0, untie_embeddings_and_output_weights=True,
        ffn_hidden_size=o.topk * o.moe_ffn if dense else o.moe_ffn,
        moe=MoEConfig() if dense else MoEConfig(
            num_experts=o.experts, moe_router_topk=o.topk, moe_ffn_hidden_size=o.moe_ffn,
            moe_aux_loss_coeff=[1e-2], **moe))


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _ours(o: argparse.Namespace, dense: bool = False, **moe) -> Callable[[torch.Tensor], float]:
    model = GPT2Model(_our_config(o, dense, **moe)).train()
    optimizer = _adamw(model)

    def step(tokens: torch.Tensor) -> float:
        begin_iteration(model, None, 1, 1)  # one micro-batch per step
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        return float(loss.detach())
    return step


@contextlib.contextmanager
def _megatron_on_cpu():
    """Megatron Core's process group of one rank and its CPU stand-ins (docs/moe.md)."""
    import torch.distributed as dist
    torch.cuda.current_device = lambda: "cpu"  # router weight and buffers, the tracker
    import megatron.core.transformer.moe.moe_utils as moe_utils
    moe_utils.te_general_gemm = None  # 0.16.1: a name bound only when Transformer Engine imports
    from megatron.core import parallel_state, tensor_parallel
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _mcore(o: argparse.Namespace) -> Callable[[torch.Tensor], float]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(
        num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads,
        num_query_groups=o.query_groups, ffn_hidden_size=o.moe_ffn, num_moe_experts=o.experts,
        moe_ffn_hidden_size=o.moe_ffn, moe_router_topk=o.topk,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather", add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=o.experts, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=o.vocab, max_sequence_length=o.seq,
                     position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).train()
    optimizer = _adamw(model)
    positions = torch.arange(o.seq).expand(o.micro_batch, o.seq)
    mask = torch.triu(torch.ones(1, 1, o.seq, o.seq, dtype=torch.bool), 1)

    def step(tokens: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        return float(loss.detach())
    return step


def main() -> None:
    o = _options()
    torch.set_num_threads(o.threads)
    torch.manual_seed(0)
    names = o.models.split(",")
    with (_megatron_on_cpu() if "mcore" in names else contextlib.nullcontext()):
        builders = {"ours": lambda: _ours(o), "dense": lambda: _ours(o, dense=True),
                    "ours-grouped": lambda: _ours(o, moe_grouped_gemm=True),
                    "ours-alltoall": lambda: _ours(o, moe_token_dispatcher_type="alltoall"),
                    "mcore": lambda: _mcore(o)}
        steps = {name: builders[name]() for name in names}
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, o.vocab, (o.micro_batch, o.seq + 1), generator=gen)
                   for _ in range(o.warmup + o.steps)]
        times: Dict[str, List[float]] = {name: [] for name in names}
        cpu: Dict[str, List[float]] = {name: [] for name in names}
        for i, tokens in enumerate(batches):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                steps[name](tokens)
                if i >= o.warmup:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
    tokens = o.micro_batch * o.seq
    flops = {"ours": model_flops_per_token(_our_config(o)),
             "dense": model_flops_per_token(_our_config(o, dense=True))}
    stats = {name: summarize(t) for name, t in times.items()}
    cpu_stats = {name: summarize(t) for name, t in cpu.items()}
    rate = {name: tokens / s["median"] for name, s in stats.items()}
    cpu_rate = {name: tokens / s["median"] for name, s in cpu_stats.items()}

    def ratio(rates: Dict[str, float], name: str, base: str) -> str:
        return f"{rates[name] / rates[base]:.2f}x" if base in rates else "-"
    rows = [(name, f"{s['median'] * 1e3:.1f}", f"{s['p90'] * 1e3:.1f}", f"{rate[name]:,.0f}",
             ratio(rate, name, "mcore"), ratio(rate, name, "dense"),
             f"{cpu_rate[name]:,.0f}", ratio(cpu_rate, name, "mcore"),
             ratio(cpu_rate, name, "dense"))
            for name, s in stats.items()]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"shape: {o.layers} layers, hidden {o.hidden}, {o.heads} heads / {o.query_groups} "
          f"groups, {o.experts} experts top-{o.topk} of width {o.moe_ffn} (dense: SwiGLU "
          f"{o.topk * o.moe_ffn}), seq {o.seq}, micro-batch {o.micro_batch}, vocab {o.vocab}; "
          f"{o.threads} threads; model FLOPs per token: MoE {flops['ours'] / 1e6:.1f} M, dense "
          f"{flops['dense'] / 1e6:.1f} M; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(format_table(["model", "median ms", "p90 ms", "tokens/s", "vs mcore", "vs dense",
                        "tokens/CPU-s", "vs mcore", "vs dense"], rows))
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"options": vars(o), "load_average": load, "tokens_per_s": rate,
                       "tokens_per_cpu_s": cpu_rate, "step_seconds": stats,
                       "step_cpu_seconds": cpu_stats, "model_flops_per_token": flops}, f,
                      indent=1)


if __name__ == "__main__":
    main()
