"""--compile-layers (each transformer layer through torch.compile) computes what eager does.

One spawn of 2 gloo ranks trains a tiny GPT-2 (fp32, dropout 0) with compiled layers at TP2
with sequence parallelism and full recompute (collectives and recomputation around compiled
layers), at PP2, under interleaved 1F1B (PP2, 2 virtual stages) and, with Llama's block
(SwiGLU, RMSNorm, no biases, qk-layernorm, RoPE, GQA), at TP2 with sequence parallelism; the parent trains each
configuration eagerly in one process, the independent reference. Each iteration's loss and
gradient norm, and every rank's gradient shard of the last iteration, must agree within float
round-off (the compiler reorders sums: a tensor's relative error ||got - want|| / ||want||
below 1e-4), and each layer must compile into whole graphs (no graph break). The parameter names, which checkpoints carry, must stay
the eager model's.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest

from tests.harness.distributed import run_distributed
from tests.harness.launch import assert_close_curves

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-4",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--make-vocab-size-divisible-by", "8", "--distributed-backend", "gloo"]
ITERS, RAW_VOCAB = 3, 64
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm",
         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups",
         "2", "--untie-embeddings-and-output-weights"]
LAYOUTS = {  # name -> (layout flags on 2 ranks, the single-process reference's flags)
    "TP2 SP full-recompute": (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--recompute-granularity", "full"], ["--recompute-granularity", "full"]),
    "PP2": (["--pipeline-model-parallel-size", "2"], []),
    "TP2 SP llama": (["--tensor-model-parallel-size", "2", "--sequence-parallel"] + LLAMA, LLAMA),
    "PP2 interleaved": (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                         "--num-layers-per-virtual-pipeline-stage", "1"], ["--num-layers", "4"]),
}
TIED_COPY = "word_embeddings.weight"  # the last stage's copy of the tied embeddings
WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"


def _train(flags: List[str], world: int) -> Dict[str, object]:
    """ITERS iterations in this process: the curve, the names and the last gradients, and how
    many graphs torch.compile made in this process so far and how often it had to split one
    (graph breaks; layers of the same code share graphs across layouts)."""
    import arguments
    from torch._dynamo.utils import counters
    from tests.harness.synthetic import build_synthetic_run
    cfg = arguments.config_from_argv(BASE + flags, world, RAW_VOCAB)
    run = build_synthetic_run(cfg, 4 * ITERS)
    curve = {}
    for it in range(1, ITERS + 1):
        out = run["trainer"].train_step(run["iterator"])
        curve[it] = (out.loss, out.grad_norm)
    grads = {name: (p.grad.detach().numpy().copy(), getattr(p, "partition_dim", -1))
             for name, p in run["model"].named_parameters()}
    ps = run["ps"]
    return {"curve": curve, "grads": grads, "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "tp_rank": ps.tensor_model_parallel_rank,
            "tp": ps.tensor_model_parallel_size, "last_stage": ps.is_pipeline_last_stage()}


def _rank() -> Dict[str, object]:
    import torch.distributed as dist
    return {name: _train(flags + ["--compile-layers"], dist.get_world_size())
            for name, (flags, _) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def compiled():
    return run_distributed(_rank, 2, timeout=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layers_equal_eager_in_one_process(compiled, name):
    want = _train(LAYOUTS[name][1], 1)
    for rank, by_layout in enumerate(compiled):
        got, what = by_layout[name], f"{name} rank {rank} (compiled) vs one eager process"
        assert got["graphs"] >= 1 and got["graph_breaks"] == 0, (what, got["graphs"])
        if got["last_stage"]:
            assert_close_curves(got["curve"], want["curve"], rel=1e-5, what=what)
        for pname, (grad, dim) in got["grads"].items():
            full = want["grads"][WORD_EMBEDDINGS if pname == TIED_COPY else pname][0]
            shard = full if dim == -1 else np.array_split(full, got["tp"], axis=dim)[got["tp_rank"]]
            if "dense_h_to_4h" in pname and "--swiglu" in LAYOUTS[name][1] and dim != -1:
                gate, up = (np.array_split(half, got["tp"])[got["tp_rank"]]
                            for half in np.split(full, 2))  # each rank: its gate and up shards
                shard = np.concatenate([gate, up])
            error = np.linalg.norm(grad - shard) / max(np.linalg.norm(shard), 1e-12)
            assert error < 1e-4, f"{what}: gradient of {pname}: ||got - want|| / ||want|| " \
                                 f"= {error:.2e}"
        # every parameter name is an eager one: checkpoints do not see the compilation
        assert set(got["grads"]) - {TIED_COPY} <= set(want["grads"]), what
