"""Context parallelism (--context-parallel-size 2) equals one process, two spawns:

- CP2 (2 ranks): p2p (key/value ring) and a2a (all-to-all over heads), with learned positions
  and with RoPE + grouped-query attention, with full and selective recompute, p2p in bf16 and
  a2a in fp16 (to half precision's round-off; fp16 skips the overflow steps one process
  skips), p2p under DeepSpeed ZeRO-2 and a2a (RoPE + GQA) under ZeRO-1 (partitions and
  gradients over data x context ranks); a
  legacy checkpoint and a torch_dist one (RoPE + GQA, distributed optimizer sharded over data x
  context ranks) saved at iteration 2 resume at CP2 bit-exactly, and (in this process) resume
  at CP1 continuing the CP2 runs' losses; the ZeRO-2 one (two optimizer pieces, one per data x
  context rank) resumes at CP2 bit-exactly.
- 4 ranks: CP2 x DP2 and CP2 x TP2, p2p and a2a, learned positions and RoPE (+ GQA), the TP2
  runs with sequence parallelism, one CP2 x DP2 run with the distributed optimizer, one with
  Muon, one under DeepSpeed ZeRO-3; CP2 x PP2 (1F1B, p2p) and CP2 x PP2 interleaved (a2a, 4
  layers, 2 virtual stages); CP4 p2p in bf16 (a ring of four).

Each rank trains 4 iterations (dropout 0, 4 micro-batches of 2 random sequences of 16 tokens
per iteration); the parent trains the same model in one process (without the layout flags)
and compares losses (last pipeline stage) and gradient norms (relative 1e-5 in fp32; 2e-3 in
half precision), and at TP1 every parameter a rank holds after training (not under ZeRO-3,
whose ranks hold pieces). A wrong chunk assignment, RoPE position, causal mask between blocks,
log-sum-exp merge, recomputed block backward, loss reduction over the context group, stage
tensor shape or gradient reduction over data x context ranks shows up as a drift in these
numbers.
"""
from __future__ import annotations

import glob
import os
from typing import Dict, List

import pytest
import torch

from tests.harness.distributed import (assert_checks_passed, expect_close, run_checks,
                                       run_distributed)

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--make-vocab-size-divisible-by", "8", "--distributed-backend", "gloo"]
ITERS, SAVED_AT, RAW_VOCAB = 4, 2, 64
ROPE_GQA = ["--position-embedding-type", "rope", "--rotary-percent", "0.5",
            "--group-query-attention", "--num-query-groups", "2"]
MODELS = {"learned": [], "rope+gqa2": ROPE_GQA,
          "rope": ["--position-embedding-type", "rope"],
          "bf16 rope+gqa2": ["--bf16"] + ROPE_GQA, "learned 4 layers": ["--num-layers", "4"],
          "fp16 learned": ["--fp16"],
          "muon learned": ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]}
HALF = dict(curve=2e-3, rtol=1e-2, atol=5e-3)  # bf16 round-off (the ring's arithmetic is fp32)
FP32 = dict(curve=1e-5, rtol=1e-4, atol=1e-5)
CP2, A2A = ["--context-parallel-size", "2"], ["--cp-comm-type", "a2a"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
INTERLEAVED = PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]
DIST_OPT = ["--use-distributed-optimizer"]
TORCH_DIST = ["--ckpt-format", "torch_dist"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO = {stage: ["--deepspeed", "--deepspeed_config",
                os.path.join(ROOT, "ds_configs", f"zero{stage}.json")] for stage in (1, 2, 3)}
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]  # the ring's shifts rerun in backward
TIED = {"word_embeddings.weight": "language_model.embedding.word_embeddings.weight"}  # last stage
LAYOUTS_2 = {  # name -> (model, layout flags)
    "CP2 p2p learned": ("learned", CP2),  # p2p rope+gqa2: with recompute, torch_dist below
    "CP2 a2a learned": ("learned", CP2 + A2A), "CP2 a2a rope+gqa2": ("rope+gqa2", CP2 + A2A),
    "CP2 p2p bf16 rope+gqa2": ("bf16 rope+gqa2", CP2),
    "CP2 p2p rope+gqa2 full recompute": ("rope+gqa2", CP2 + FULL),
    "CP2 p2p learned selective recompute": ("learned", CP2 + ["--recompute-granularity",
                                                              "selective"]),
    "CP2 a2a rope+gqa2 selective recompute": ("rope+gqa2", CP2 + A2A + [
        "--recompute-granularity", "selective"]),
    "CP2 p2p rope+gqa2 distributed optimizer torch_dist": ("rope+gqa2",
                                                           CP2 + DIST_OPT + TORCH_DIST),
    "CP2 p2p learned DeepSpeed ZeRO-2": ("learned", CP2 + ZERO[2]),
    "CP2 a2a rope+gqa2 DeepSpeed ZeRO-1": ("rope+gqa2", CP2 + A2A + ZERO[1]),
    "CP2 a2a fp16 learned": ("fp16 learned", CP2 + A2A),
}
SAVED = {"CP2 p2p learned": ("legacy", []),  # layout -> (folder, flags of the CP1 resume)
         "CP2 p2p rope+gqa2 distributed optimizer torch_dist": ("torch_dist", TORCH_DIST),
         # ZeRO partitions over data x context: resumed at CP2 only (another size is refused)
         "CP2 p2p learned DeepSpeed ZeRO-2": ("deepspeed", None)}
LAYOUTS_4 = {
    "CP2xDP2 p2p learned": ("learned", CP2),  # p2p rope+gqa2: distributed optimizer below
    "CP2xDP2 a2a rope": ("rope", CP2 + A2A),
    "CP2xDP2 p2p rope+gqa2 distributed optimizer": ("rope+gqa2", CP2 + DIST_OPT),
    "CP2xTP2 p2p sp learned": ("learned", CP2 + TP2_SP),
    "CP2xTP2 p2p sp rope+gqa2": ("rope+gqa2", CP2 + TP2_SP),
    "CP2xTP2 a2a sp rope": ("rope", CP2 + A2A + TP2_SP),
    "CP2xPP2 p2p rope+gqa2": ("rope+gqa2", CP2 + PP2),
    "CP2xPP2 interleaved a2a learned": ("learned 4 layers", CP2 + A2A + INTERLEAVED),
    "CP2xDP2 p2p muon learned": ("muon learned", CP2),
    "CP2xDP2 p2p rope+gqa2 DeepSpeed ZeRO-3": ("rope+gqa2", CP2 + ZERO[3]),
    # four ring steps: key/value blocks and their gradients in flight together (bf16: two sizes)
    "CP4 p2p bf16 rope+gqa2": ("bf16 rope+gqa2", ["--context-parallel-size", "4"]),
}


def _build(flags: List[str], world: int, load: str = ""):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    argv = BASE + flags + (["--load", load] if load else [])
    return build_synthetic_run(arguments.config_from_argv(argv, world, RAW_VOCAB), 8 * ITERS)


def _train(run, iterations: int, iterator=None):
    iterator = run["iterator"] if iterator is None else iterator
    return [(s.loss, s.grad_norm) for s in
            (run["trainer"].train_step(iterator) for _ in range(iterations))]


def _params(run) -> Dict[str, torch.Tensor]:
    # numpy-backed copies: a rank's shared-memory tensors are gone once it exits
    return {name: torch.from_numpy(p.detach().float().numpy().copy())
            for name, p in run["model"].named_parameters()}


def _resume(flags: List[str], world: int, load_dir: str):
    """A run loaded from `load_dir`, with its data iterator at the saved position."""
    from app.training.data_loading import build_data_iterator
    run = _build(flags, world, load_dir)
    loaded = run["engine"].load_checkpoint(load_dir)
    assert loaded.iteration == SAVED_AT, loaded
    iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples, 2,
                                   run["ps"], 0)
    return run, iterator


def _rank(layouts, save_dir: str = ""):
    """Train every layout; with `save_dir` also save the SAVED ones at SAVED_AT (each in its
    folder) and check that they resume at the same layout bit-exactly."""
    import os

    import torch.distributed as dist
    world, results = dist.get_world_size(), {}
    checks = {}
    for name, (model, layout) in layouts.items():
        def train(name=name, flags=MODELS[model] + layout):
            run = _build(flags, world)
            curve = _train(run, SAVED_AT)
            if save_dir and name in SAVED:
                folder = os.path.join(save_dir, SAVED[name][0])
                run["engine"].save_checkpoint(folder, SAVED_AT, dict(
                    iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT,
                    consumed_valid_samples=0))
            curve += _train(run, ITERS - SAVED_AT)
            params = {} if "ZeRO-3" in name else _params(run)  # ZeRO-3: each rank a piece
            results[name] = (curve, params, run["ps"].tensor_model_parallel_size)
        checks[name] = train
    for saved, (folder, _) in SAVED.items() if save_dir else ():
        def resumes_bit_exactly(saved=saved, folder=os.path.join(save_dir, folder)):
            model, layout = layouts[saved]
            run, iterator = _resume(MODELS[model] + layout, world, folder)
            got, want = _train(run, ITERS - SAVED_AT, iterator), results[saved][0]
            for i, ((loss, norm), (w_loss, w_norm)) in enumerate(zip(got, want[SAVED_AT:])):
                expect_close(loss, w_loss, f"resumed loss at {i}", rtol=0.0, atol=0.0)
                expect_close(norm, w_norm, f"resumed grad norm at {i}", rtol=0.0, atol=0.0)
        checks[f"{saved}: resume at CP2 is bit-exact"] = resumes_bit_exactly
    return run_checks(checks), results


@pytest.fixture(scope="module")
def references():
    """One process, same seed, no layout flags: (curve, parameters) of each model."""
    out = {}
    for model, flags in MODELS.items():
        run = _build(flags, 1)
        out[model] = (_train(run, ITERS), _params(run))
    return out


def _compare(outcomes, layouts, references) -> None:
    assert_checks_passed([outcome for outcome, _ in outcomes])
    for rank, (_, results) in enumerate(outcomes):
        for name, (model, _) in layouts.items():
            curve, params, tp = results[name]
            want_curve, want_params = references[model]
            tol = HALF if "16" in model else FP32
            for i, ((loss, norm), (w_loss, w_norm)) in enumerate(zip(curve, want_curve)):
                what = f"{name} rank {rank} iteration {i + 1}"
                if loss is not None:  # None on a pipeline's earlier stages
                    assert loss == pytest.approx(w_loss, rel=tol["curve"]), f"{what}: loss"
                if w_norm is None:  # fp16: a step skipped for an overflow is skipped here too
                    assert norm is None, f"{what}: grad norm {norm}, one process skipped"
                else:
                    assert norm == pytest.approx(w_norm, rel=tol["curve"]), f"{what}: grad norm"
            if tp == 1:
                for pname, value in params.items():
                    want = want_params[TIED.get(pname, pname)]
                    torch.testing.assert_close(value, want, rtol=tol["rtol"],
                                               atol=tol["atol"],
                                               msg=lambda m, n=pname: f"{name} {n}: {m}")


def test_cp2_p2p_and_a2a_equal_one_process_and_resume(references, tmp_path):
    save_dir = str(tmp_path / "ck")
    outcomes = run_distributed(_rank, 2, LAYOUTS_2, save_dir, timeout=400)
    _compare(outcomes, LAYOUTS_2, references)
    # each CP2 checkpoint resumes in one process, continuing the CP2 run
    for saved, (folder, flags) in SAVED.items():
        if flags is None:
            continue
        model, _ = LAYOUTS_2[saved]
        run, iterator = _resume(MODELS[model] + flags, 1, str(tmp_path / "ck" / folder))
        got = _train(run, ITERS - SAVED_AT, iterator)
        want = outcomes[0][1][saved][0][SAVED_AT:]
        for i, ((loss, norm), (w_loss, w_norm)) in enumerate(zip(got, want)):
            assert loss == pytest.approx(w_loss, rel=1e-5), f"{saved} at CP1, {i}: loss"
            assert norm == pytest.approx(w_norm, rel=1e-5), f"{saved} at CP1, {i}: grad norm"
    args = torch.load(str(tmp_path / "ck" / "legacy" / "iter_0000002" / "mp_rank_00"
                          / "model_optim_rng.pt"), weights_only=False)["args"]
    assert args.context_parallel_size == 2  # Megatron's name
    # DeepSpeed partitioned the optimizer over the data x context ranks: two ZeRO pieces
    pieces = glob.glob(str(tmp_path / "ck" / "deepspeed" / "*" / "*optim_states.pt"))
    assert len(pieces) == 2, pieces


def test_cp2xdp2_and_cp2xtp2_equal_one_process(references):
    outcomes = run_distributed(_rank, 4, LAYOUTS_4, timeout=400)
    _compare(outcomes, LAYOUTS_4, references)
