"""Model options at parallel layouts equal one process: sequence parallelism, RoPE,
ALiBi, GQA, MQA (key/value heads replicated over TP), untied output layer, recompute and a
custom logits loss, and Llama's block (SwiGLU, RMSNorm, no biases, RoPE, GQA 2, untied; with
--qk-layernorm under SP at TP2xPP2, in fp16 at PP2 and under DeepSpeed ZeRO-2 at DP2; with the
distributed optimizer at DP2; in bf16 with SP and selective recompute at TP2; interleaved with
full recompute at TP2xPP2), alone and combined, at TP2, PP2 (2 ranks), TP2xDP2 and TP2xPP2 (4 ranks);
one combination each also in native bf16 and fp16 (to their round-off), one under interleaved 1F1B (TP2xPP2,
2 virtual stages) and one with the distributed optimizer (TP2xDP2); Megatron's options of its
launch scripts: Nemotron-Mini's block (LayerNorm-1p, squared ReLU, rotary 0.5, no biases) at TP2,
Qwen2/Llama 3.1's (QKV bias only, llama3 RoPE scaling, RMSNorm-1p, MQA: replicated QKV bias
rows) at TP2 with SP and at PP2; the per-token loss with decoupled LRs at PP2 (tied copy) and
TP2xDP2, in bf16 with bf16 gradient reduction under the distributed optimizer (TP2xDP2) and
under DeepSpeed ZeRO-2 (DP2), and with Mixture of Experts at EP2. Mixture of Experts, a
Qwen3-MoE-shaped model (Llama block + QK-norm, 4 experts, top-2, aux and z losses, dropless),
8 iterations: EP2 (allgather; alltoall with the distributed optimizer and both overlaps),
TP2 with the experts split by TP (SP), PP2 with a first stage holding no MoE layer (and
selective recompute of its dense MLP and MoE layer), fp16 at EP2; every other MoE option (sigmoid scores, expert bias, seq and global load balancing,
z-loss, shared expert and its gate, fp32 router, grouped GEMM, per-layer logging) with the
alltoall dispatcher and full recompute at TP2; Muon (one matrix per expert) at TP2; on 4 ranks
EP2 x TP2 (with --moe-layer-recompute: the dispatch reruns in backward), expert TP 1 under TP2 with the distributed optimizer and Muon (experts sharded over
four expert-data-parallel ranks), and
PP2 x EP2 interleaved with a stage without MoE layers. The MoE metrics (losses by Megatron's
names, tokens per expert) must equal one process's too.

Two spawns. Each rank builds every run in-process (tests.harness.synthetic.build_synthetic_run,
the same path as pretrain_gpt2) and trains 5 iterations (fp32, dropout 0, 4 or 2 micro-batches
of random tokens); the parent trains the same configuration in one process and compares the
losses and gradient norms (relative 1e-5, the suite's parity tolerance) and every parameter
after training with its shard of the single-process weights. A LayerNorm gradient not summed
over TP under sequence parallelism, a replicated key/value gradient not summed, a wrong norm
count or a wrong tie shows up as a drift in these numbers.
"""
from __future__ import annotations

import os
from typing import Dict, List

import pytest
import torch

from tests.harness.distributed import run_distributed
from tests.harness.launch import assert_close_curves

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--make-vocab-size-divisible-by", "8", "--peak-flops", "1e12",
        "--distributed-backend", "gloo"]
ITERS, MOE_ITERS, RAW_VOCAB = 5, 8, 64
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SP, UNTIE = ["--sequence-parallel"], ["--untie-embeddings-and-output-weights"]
ROPE = ["--position-embedding-type", "rope", "--rotary-percent", "0.5"]
ALIBI = ["--position-embedding-type", "alibi"]
GQA2 = ["--group-query-attention", "--num-query-groups", "2"]
MQA = ["--group-query-attention", "--num-query-groups", "1"]
RESETS = ["--reset-position-ids", "--reset-attention-mask"]  # token 0 is the EOD: explicit masks
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--position-embedding-type", "rope"] + GQA2 + UNTIE  # Llama's block
ZERO2 = ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json")]
NEMOTRON = ["--apply-layernorm-1p", "--squared-relu", "--use-rotary-position-embeddings",
            "--rotary-percent", "0.5", "--no-position-embedding",
            "--disable-bias-linear"] + GQA2 + UNTIE  # Nemotron-Mini's block
QWEN2_LLAMA31 = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                 "--add-qkv-bias", "--position-embedding-type", "rope", "--use-rope-scaling",
                 "--rope-scaling-factor", "32", "--apply-layernorm-1p"] + MQA + UNTIE
PER_TOKEN = ["--calculate-per-token-loss", "--eod-mask-loss",  # token 0 is the EOD
             "--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4"]
# Qwen3-MoE's shape: the Llama block + QK-norm, 4 experts, top-2, aux and z losses (dropless)
QWEN3_MOE = LLAMA + ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2",
                     "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2",
                     "--moe-z-loss-coeff", "1e-3"]
EP2, A2A = ["--expert-model-parallel-size", "2"], ["--moe-token-dispatcher-type", "alltoall"]
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]  # experts: one matrix each
DENSE_FIRST = ["--moe-layer-freq", "[0,1]"]  # at PP2 the first stage holds no MoE layer
MOE_OPTIONS = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
               "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
               "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
               "--moe-aux-loss-coeff", "1e-2", "1e-3", "--moe-z-loss-coeff", "1e-3",
               "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
               "--moe-router-dtype", "fp32", "--moe-grouped-gemm", "--moe-per-layer-logging"]

# name -> (model flags, whether the loss is the custom logits loss)
OPTIONS = {
    "sp": (SP, False),
    "rope": (ROPE, False),
    "alibi": (ALIBI + RESETS, False),
    "gqa2": (GQA2, False),
    "mqa": (MQA, False),
    "untied": (UNTIE, False),
    "recompute-full-block": (["--recompute-granularity", "full", "--recompute-method", "block",
                              "--recompute-num-layers", "1"], False),
    "logits-loss": ([], True),
    "sp+rope+gqa2+untied+selective": (SP + ROPE + GQA2 + UNTIE
                                      + ["--recompute-granularity", "selective"], False),
    "sp+alibi+mqa+full+resets": (SP + ALIBI + MQA + RESETS + ["--checkpoint-activations"], True),
    "sp+learned+untied": (SP + UNTIE, False),
    "bf16 sp+rope+mqa+untied+selective": (["--bf16"] + SP + ROPE + MQA + UNTIE
                                          + ["--recompute-granularity", "selective"], False),
    "fp16 sp+alibi+gqa2+untied": (["--fp16", "--initial-loss-scale", "1024"] + SP + ALIBI
                                  + GQA2 + UNTIE, False),
    # combined with interleaved 1F1B and with the distributed optimizer
    "interleaved sp+rope+untied": (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                                    "1"] + SP + ROPE + UNTIE, False),
    "distributed optimizer sp+mqa": (["--use-distributed-optimizer"] + SP + MQA, False),
    "llama": (LLAMA, False),
    "sp+llama+qk-layernorm": (SP + LLAMA + ["--qk-layernorm"], False),
    "distributed optimizer llama": (["--use-distributed-optimizer"] + LLAMA, False),
    "deepspeed zero2 llama+qk-layernorm": (ZERO2 + LLAMA + ["--qk-layernorm"], False),
    "bf16 sp+llama+selective": (["--bf16"] + SP + LLAMA + ["--recompute-granularity",
                                                          "selective"], False),
    "fp16 llama+qk-layernorm": (["--fp16", "--initial-loss-scale", "1024"] + LLAMA
                                + ["--qk-layernorm"], False),
    "interleaved sp+llama+full": (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                                   "1", "--recompute-granularity", "full"] + SP + LLAMA, False),
    # Megatron's model options of its launch scripts (Nemotron-Mini, Qwen2.5, Llama 3.1), and its
    # per-token loss with decoupled LRs (one process: sum / the global batch's token count)
    "nemotron": (NEMOTRON, False),
    "sp+qwen2+llama3.1 mqa": (SP + QWEN2_LLAMA31, False),
    "qwen2+llama3.1 mqa": (QWEN2_LLAMA31, False),
    "per-token+decoupled": (PER_TOKEN, False),
    "per-token+decoupled untied": (PER_TOKEN + UNTIE, False),
    "bf16 distributed optimizer grad-reduce-in-bf16 per-token": (
        ["--bf16", "--grad-reduce-in-bf16", "--use-distributed-optimizer"] + PER_TOKEN, False),
    "deepspeed zero2 bf16 grad-reduce-in-bf16 per-token": (
        ZERO2 + ["--bf16", "--grad-reduce-in-bf16"] + PER_TOKEN + LLAMA, False),
    # Mixture of Experts (8 iterations): EP2 with either dispatcher, experts split by TP
    # (ETP = TP, SP), EP2 x TP2, expert TP 1 under TP2, PP2 with a stage without MoE layers
    # (plain and interleaved x EP2), the distributed optimizer (experts sharded over their own
    # expert-data-parallel group), full recompute, selective recompute of the MoE layer (its
    # dispatch rerun in backward) and the dense MLP, fp16, and the other MoE options
    "qwen3-moe ep2": (QWEN3_MOE + EP2, False),
    "distributed optimizer qwen3-moe ep2 alltoall": (
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        + QWEN3_MOE + EP2 + A2A, False),
    "sp+qwen3-moe": (SP + QWEN3_MOE, False),
    "qwen3-moe dense first layer recompute mlp+moe": (
        QWEN3_MOE + DENSE_FIRST + ["--recompute-granularity", "selective",
                                   "--recompute-modules", "mlp", "moe"], False),
    "sp+moe options alltoall full": (SP + MOE_OPTIONS + A2A + ["--recompute-granularity",
                                                               "full"], False),
    "fp16 qwen3-moe ep2": (["--fp16", "--initial-loss-scale", "1024"] + QWEN3_MOE + EP2, False),
    "qwen3-moe ep2 per-token": (QWEN3_MOE + EP2 + PER_TOKEN, False),  # aux grads x R / N
    "sp+qwen3-moe ep2 moe-layer-recompute": (SP + QWEN3_MOE + EP2 + ["--moe-layer-recompute"],
                                             False),
    "muon sp+qwen3-moe": (MUON + SP + QWEN3_MOE, False),
    "distributed optimizer muon sp+qwen3-moe etp1": (
        ["--use-distributed-optimizer"] + MUON + SP + QWEN3_MOE
        + ["--expert-tensor-parallel-size", "1"], False),
    "interleaved qwen3-moe ep2": (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                                   "1", "--moe-layer-freq", "[0,1,0,1]"] + QWEN3_MOE + EP2, False),
}
LAYOUT_ONLY = {"--sequence-parallel": 0, "--use-distributed-optimizer": 0,
               "--num-layers-per-virtual-pipeline-stage": 1, "--deepspeed": 0,
               "--deepspeed_config": 1, "--expert-model-parallel-size": 1,
               "--expert-tensor-parallel-size": 1, "--overlap-grad-reduce": 0,
               "--overlap-param-gather": 0}
"""Flags that change how a layout runs, not the numbers (with their argument count): the
single-process reference runs without them."""
HALF_TOLERANCE = dict(curve=2e-3, rtol=1e-2, atol=5e-3)  # bf16/fp16 round-off; Adam steps noise
LAYOUTS_2 = [  # (option, tp, pp) on 2 ranks
    ("sp", 2, 1), ("rope", 2, 1), ("alibi", 2, 1), ("gqa2", 2, 1), ("mqa", 2, 1),
    ("untied", 2, 1), ("recompute-full-block", 2, 1), ("logits-loss", 2, 1),
    ("sp+rope+gqa2+untied+selective", 2, 1), ("sp+alibi+mqa+full+resets", 2, 1),
    ("untied", 1, 2), ("alibi", 1, 2), ("rope", 1, 2), ("bf16 sp+rope+mqa+untied+selective", 2, 1),
    ("fp16 sp+alibi+gqa2+untied", 2, 1),
    ("llama", 2, 1), ("llama", 1, 2), ("distributed optimizer llama", 1, 1),
    ("bf16 sp+llama+selective", 2, 1), ("fp16 llama+qk-layernorm", 1, 2),
    ("nemotron", 2, 1), ("sp+qwen2+llama3.1 mqa", 2, 1), ("qwen2+llama3.1 mqa", 1, 2),
    ("per-token+decoupled", 1, 2),
    ("qwen3-moe ep2", 1, 1), ("distributed optimizer qwen3-moe ep2 alltoall", 1, 1),
    ("sp+qwen3-moe", 2, 1), ("qwen3-moe dense first layer recompute mlp+moe", 1, 2),
    ("sp+moe options alltoall full", 2, 1), ("fp16 qwen3-moe ep2", 1, 1),
    ("qwen3-moe ep2 per-token", 1, 1),
    ("muon sp+qwen3-moe", 2, 1),
    ("deepspeed zero2 llama+qk-layernorm", 1, 1),  # last: DeepSpeed's recompute stays set
    ("deepspeed zero2 bf16 grad-reduce-in-bf16 per-token", 1, 1),
]
LAYOUTS_4 = [  # on 4 ranks: TP2 x DP2 and TP2 x PP2 (sequence-parallel slices between stages)
    ("sp", 2, 1), ("sp+rope+gqa2+untied+selective", 2, 1),
    ("sp+learned+untied", 2, 2), ("sp+alibi+mqa+full+resets", 2, 2),
    ("interleaved sp+rope+untied", 2, 2), ("distributed optimizer sp+mqa", 2, 1),
    ("sp+llama+qk-layernorm", 2, 2), ("interleaved sp+llama+full", 2, 2),
    ("per-token+decoupled untied", 2, 1), ("bf16 distributed optimizer grad-reduce-in-bf16 "
                                           "per-token", 2, 1),
    ("sp+qwen3-moe ep2 moe-layer-recompute", 2, 1), ("distributed optimizer muon sp+qwen3-moe etp1", 2, 1),
    ("interleaved qwen3-moe ep2", 1, 2),
]


def z_loss_cross_entropy(logits: torch.Tensor, batch: Dict[str, torch.Tensor]):
    """A logits loss written like single-device code: masked-mean cross-entropy + 1e-2 z-loss."""
    import torch.nn.functional as F
    b, s, v = logits.shape
    ce = F.cross_entropy(logits.float().view(b * s, v), batch["labels"].reshape(-1),
                         reduction="none").view(b, s)
    z = torch.logsumexp(logits.float(), dim=-1) ** 2  # [b, s]
    mask = batch["loss_mask"]
    mean = lambda t: (t * mask).sum() / mask.sum()  # noqa: E731
    return mean(ce) + 1e-2 * mean(z), {"z": mean(z).detach()}


def _iterations(flags: List[str]) -> int:
    return MOE_ITERS if "--num-experts" in flags else ITERS


def _train(flags: List[str], custom_loss: bool, world: int) -> Dict[str, object]:
    """5 iterations (8 with experts) of one configuration in this process: curve, metrics,
    final parameters."""
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    from app.training.loss import LossFunction
    loss = LossFunction(z_loss_cross_entropy, inputs="logits") if custom_loss else None
    iters = _iterations(flags)
    cfg = arguments.config_from_argv(BASE + flags + ["--train-iters", str(iters)], world,
                                     RAW_VOCAB)
    run = build_synthetic_run(cfg, 8 * iters, loss_function=loss)
    curve, metrics = {}, []
    for it in range(1, iters + 1):
        out = run["trainer"].train_step(run["iterator"])
        curve[it] = (out.loss, out.grad_norm)
        metrics.append(out.metrics)
    # numpy copies: tensors would travel back from a rank through shared memory that is gone
    # once the rank exits
    params = {name: (p.detach().float().numpy().copy(), getattr(p, "partition_dim", -1))
              for name, p in run["model"].named_parameters()}
    ps = run["ps"]
    return {"curve": curve, "metrics": metrics, "params": params,
            "tp_rank": ps.tensor_model_parallel_rank, "last_stage": ps.is_pipeline_last_stage(),
            "experts": (ps.expert_model_parallel_rank, ps.expert_model_parallel_size,
                        ps.expert_tensor_parallel_rank, ps.expert_tensor_parallel_size)}


def _rank(layouts) -> Dict[str, object]:
    import torch.distributed as dist
    results = {}
    for name, tp, pp in layouts:
        flags, custom = OPTIONS[name]
        layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
        results[(name, tp, pp)] = _train(flags + layout, custom, dist.get_world_size())
    return results


@pytest.fixture(scope="module")
def references():
    """The single-process run of every option (trained in the test process, without the
    layout-only flags)."""
    return {name: _train(_reference_flags(flags), custom, 1)
            for name, (flags, custom) in OPTIONS.items()}


def _reference_flags(flags: List[str]) -> List[str]:
    out, skip = [], 0
    for flag in flags:
        if skip:
            skip -= 1
        elif flag in LAYOUT_ONLY:
            skip = LAYOUT_ONLY[flag]
        else:
            out.append(flag)
    return out


def _query_groups(flags: List[str]) -> int:
    return int(flags[flags.index("--num-query-groups") + 1]) if "--num-query-groups" in flags else 4


def _qkv_rows_of_rank(full: torch.Tensor, tp: int, tp_rank: int, groups: int, heads: int = 4,
                      head_dim: int = 8) -> torch.Tensor:
    """The rows of the dense fused-QKV parameter a TP rank holds when there are fewer key/value
    groups than TP ranks: its heads / TP query heads, then the key and value of their group.
    The dense layout (Megatron's) is, per group, its query heads, its key, its value, each
    head_dim rows."""
    per_group = heads // groups
    block = per_group + 2  # head blocks of one group: queries, key, value

    def rows(index):  # head block `index` of the dense layout
        return full[index * head_dim:(index + 1) * head_dim]

    first = tp_rank * (heads // tp)
    queries = [rows(q // per_group * block + q % per_group)
               for q in range(first, first + heads // tp)]
    key = first // per_group * block + per_group  # the key, then the value, of their group
    return torch.cat(queries + [rows(key), rows(key + 1)])


def _expected_shard(name: str, full: torch.Tensor, dim: int, tp: int, tp_rank: int,
                    groups: int, swiglu: bool = False, experts=(0, 1, 0, 1)) -> torch.Tensor:
    """This rank's part of a single-process parameter: replicated, a contiguous TP slice, or
    (fewer key/value groups than TP ranks) its query heads and their group's key and value;
    a routed expert weight: its EP rank's experts, each cut over the expert-TP ranks."""
    if ".mlp.experts." in name:
        ep_rank, ep, etp_rank, etp = experts
        local = full.chunk(ep)[ep_rank]  # [E/EP, ...]
        return _expected_shard(name.replace(".mlp.experts.", ".mlp."), local, dim, etp,
                               etp_rank, groups, swiglu and dim == 1)
    if "query_key_value" in name and groups < tp:
        return _qkv_rows_of_rank(full, tp, tp_rank, groups)
    if "dense_h_to_4h" in name and dim != -1 and swiglu:  # [gate; up]: each rank both shards
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim)[tp_rank], up.chunk(tp, dim)[tp_rank]], dim)
    return full if dim == -1 else full.chunk(tp, dim=dim)[tp_rank]


def _compare(results, references, world: int) -> None:
    for rank, by_layout in enumerate(results):
        for (name, tp, pp), got in by_layout.items():
            want = references[name]
            what = f"{name} TP{tp} PP{pp} DP{world // (tp * pp)} rank {rank}"
            groups = _query_groups(OPTIONS[name][0])
            half = {"--bf16", "--fp16"} & set(OPTIONS[name][0])
            tol = HALF_TOLERANCE if half else dict(curve=1e-5, rtol=1e-4, atol=1e-5)
            if got["last_stage"]:
                assert_close_curves(got["curve"], want["curve"], rel=tol["curve"], what=what)
                for g, w in zip(got["metrics"], want["metrics"]):
                    assert g.keys() == w.keys(), what
                    for key in w:  # half precision: routing near ties may flip a token
                        if not (half and isinstance(w[key], list)):
                            assert g[key] == pytest.approx(w[key], rel=1e-2 if half else 1e-5,
                                                           abs=1e-7), (what, key)
            for pname, (value, dim) in got["params"].items():
                ref_name = ("language_model.embedding.word_embeddings.weight"
                            if pname == "word_embeddings.weight" else pname)
                expected = _expected_shard(pname, torch.from_numpy(want["params"][ref_name][0]),
                                           dim, tp, got["tp_rank"], groups,
                                           "--swiglu" in OPTIONS[name][0], got["experts"])
                # atol: zero-gradient entries (the key bias) take round-off-sized Adam steps
                torch.testing.assert_close(torch.from_numpy(value), expected, rtol=tol["rtol"],
                                           atol=tol["atol"],
                                           msg=lambda m, n=pname: f"{what} {n}: {m}")


def test_options_at_tp2_and_pp2_equal_one_process(references):
    results = run_distributed(_rank, 2, LAYOUTS_2, timeout=300)
    _compare(results, references, 2)


def test_options_at_tp2xdp2_and_tp2xpp2_equal_one_process(references):
    results = run_distributed(_rank, 4, LAYOUTS_4, timeout=300)
    _compare(results, references, 4)
