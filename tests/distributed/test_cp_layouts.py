"""Context parallelism (--context-parallel-size 2) equals one process, two spawns:

- CP2 (2 ranks): p2p (key/value ring) and a2a (all-to-all over heads), with learned positions
  and with RoPE + grouped-query attention, with full and selective recompute, p2p in bf16 and
  a2a in fp16 (to half precision's round-off; fp16 skips the overflow steps one process
  skips), p2p under DeepSpeed ZeRO-2 and a2a (RoPE + GQA) under ZeRO-1 (partitions and
  gradients over data x context ranks); a legacy checkpoint and a torch_dist one (RoPE + GQA,
  distributed optimizer sharded over data x context ranks) saved at iteration 2 resume at CP2
  bit-exactly, and (in this process) resume at CP1 continuing the CP2 runs' losses; the ZeRO-2
  one (two optimizer pieces, one per data x context rank) resumes at CP2 bit-exactly and at
  CP1 x DP2 (two pieces again) continuing the CP2 run, and in this process at CP1 (one piece):
  refused as saved, naming both context sizes and the universal checkpoint (by the start-up
  check too), continuing the CP2 run once converted by DeepSpeed's ds_to_universal, and with
  --no-load-optim or --finetune (weights) giving the CP2 run's next loss and gradient norm.
  CP2 x EP2 (the expert group is the context group: both fold onto the two ranks) trains a
  Qwen3-MoE-shaped model (Llama block + QK-norm, 4 experts, top-2, aux and z losses) for 8
  iterations like one process.
- 4 ranks: CP2 x DP2 and CP2 x TP2, p2p and a2a, learned positions and RoPE (+ GQA), the TP2
  runs with sequence parallelism, one CP2 x DP2 run with the distributed optimizer, one with
  Muon, one under DeepSpeed ZeRO-3; CP2 x PP2 (1F1B, p2p; natively and under DeepSpeed ZeRO-1,
  DeepSpeed's pipeline rule) and CP2 x PP2 interleaved (a2a, 4 layers, 2 virtual stages); CP4 p2p in bf16 (a ring of four).

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

import contextlib
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
          "muon learned": ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"],
          # Qwen3-MoE's shape: Llama block + QK-norm, 4 experts, top-2, aux loss (8 iterations)
          "qwen3-moe": ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                        "--qk-layernorm", "--untie-embeddings-and-output-weights", "--num-experts",
                        "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
                        "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"] + ROPE_GQA}
MOE_ITERS = 8
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
    # CP and EP fold onto the same ranks: the expert group is the context group
    "CP2xEP2 p2p qwen3-moe": ("qwen3-moe", CP2 + ["--expert-model-parallel-size", "2"]),
}
SAVED = {"CP2 p2p learned": ("legacy", []),  # layout -> (folder, flags of the CP1 resume)
         "CP2 p2p rope+gqa2 distributed optimizer torch_dist": ("torch_dist", TORCH_DIST),
         # ZeRO partitions over data x context ranks: at CP1 x DP2 as saved, at CP1 through a
         # universal checkpoint (_deepspeed_at_cp1)
         "CP2 p2p learned DeepSpeed ZeRO-2": ("deepspeed", None)}
LAYOUTS_4 = {
    "CP2xDP2 p2p learned": ("learned", CP2),  # p2p rope+gqa2: distributed optimizer below
    "CP2xDP2 a2a rope": ("rope", CP2 + A2A),
    "CP2xDP2 p2p rope+gqa2 distributed optimizer": ("rope+gqa2", CP2 + DIST_OPT),
    "CP2xTP2 p2p sp learned": ("learned", CP2 + TP2_SP),
    "CP2xTP2 p2p sp rope+gqa2": ("rope+gqa2", CP2 + TP2_SP),
    "CP2xTP2 a2a sp rope": ("rope", CP2 + A2A + TP2_SP),
    "CP2xPP2 p2p rope+gqa2": ("rope+gqa2", CP2 + PP2),
    # DeepSpeed's pipeline rule: ZeRO-1 only (one engine per stage, our 1F1B schedule)
    "CP2xPP2 p2p learned DeepSpeed ZeRO-1": ("learned", CP2 + PP2 + ZERO[1]),
    "CP2xPP2 interleaved a2a learned": ("learned 4 layers", CP2 + A2A + INTERLEAVED),
    "CP2xDP2 p2p muon learned": ("muon learned", CP2),
    "CP2xDP2 p2p rope+gqa2 DeepSpeed ZeRO-3": ("rope+gqa2", CP2 + ZERO[3]),
    # four ring steps: key/value blocks and their gradients in flight together (bf16: two sizes)
    "CP4 p2p bf16 rope+gqa2": ("bf16 rope+gqa2", ["--context-parallel-size", "4"]),
}


def _iterations(model: str) -> int:
    return MOE_ITERS if "moe" in model else ITERS


def _build(flags: List[str], world: int, load: str = ""):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    argv = BASE + flags + (["--load", load] if load else [])
    samples = 8 * (MOE_ITERS if "--num-experts" in flags else ITERS)
    return build_synthetic_run(arguments.config_from_argv(argv, world, RAW_VOCAB), samples)


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
            curve += _train(run, _iterations(layouts[name][0]) - SAVED_AT)
            params = {} if "ZeRO-3" in name else _params(run)  # ZeRO-3: each rank a piece
            ps = run["ps"]
            results[name] = (curve, params, ps.tensor_model_parallel_size,
                             (ps.expert_model_parallel_rank, ps.expert_model_parallel_size))
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
    if save_dir:
        checks["ZeRO-2 at CP2 resumes at CP1 x DP2 (two partitions)"] = lambda: _continues(
            _resume(ZERO[2], world, os.path.join(save_dir, "deepspeed")),
            results["CP2 p2p learned DeepSpeed ZeRO-2"][0], expect_close)
    return run_checks(checks), results


def _continues(resumed, curve, close, iterations: int = ITERS - SAVED_AT) -> None:
    """The first `iterations` steps of a (run, iterator) resumed at SAVED_AT repeat `curve`'s
    steps after SAVED_AT (relative 1e-5), each compared by close(got, want, what, rtol=...)."""
    run, iterator = resumed
    got = _train(run, iterations, iterator)
    for i, ((loss, norm), (w_loss, w_norm)) in enumerate(zip(got, curve[SAVED_AT:])):
        close(loss, w_loss, f"loss {i}", rtol=1e-5)
        close(norm, w_norm, f"grad norm {i}", rtol=1e-5)


def _approx(got, want, what, rtol):
    assert got == pytest.approx(want, rel=rtol), what


@contextlib.contextmanager
def _own_process_group():
    """DeepSpeed at one rank in this process starts a process group and exports RANK,
    WORLD_SIZE, MASTER_PORT...: both are undone on exit, so that later tests find neither."""
    import torch.distributed as dist
    environ = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def _deepspeed_at_cp1(ck: str, curve) -> None:
    """The ZeRO-2 checkpoint saved at CP2 (two optimizer partitions, one per data x context
    rank) at CP1 in one process: as saved it is refused naming both context sizes and the
    universal checkpoint, by the start-up check too (which accepts it at CP2); converted to a
    universal checkpoint it continues the CP2 run; with --no-load-optim or --finetune its
    weights give the CP2 run's next loss and gradient norm on the same data (the later steps
    differ: fresh Adam moments)."""
    import argparse

    import arguments

    from app.checkpoint import CheckpointError
    from app.training.data_loading import build_data_iterator
    from app.training.checkpointing.resume import check_resume
    check_resume(arguments.config_from_argv(BASE + CP2 + ZERO[2] + ["--load", ck], 2, RAW_VOCAB),
                 ck)
    refusal = (r"over 2 data x context ranks \(saved at context-parallel size 2, data-parallel "
               r"size 1\), and this run has 1 \(context-parallel size 1.*ds_to_universal.*"
               r"--universal-checkpoint.*--no-load-optim")
    with pytest.raises(CheckpointError, match=refusal):
        check_resume(arguments.config_from_argv(BASE + ZERO[2] + ["--load", ck], 1, RAW_VOCAB),
                     ck)
    with _own_process_group():
        with pytest.raises(CheckpointError, match=refusal):
            _resume(ZERO[2], 1, ck)
        _continues(_resume(ZERO[2] + ["--no-load-optim"], 1, ck), curve, _approx, 1)
        run = _build(ZERO[2] + ["--finetune"], 1, ck)  # the weights, from iteration 0
        assert run["engine"].load_checkpoint(ck).iteration == 0
        _continues((run, build_data_iterator(run["trainer"].train_ds, 8 * SAVED_AT, 2,
                                             run["ps"], 0)), curve, _approx, 1)
        from deepspeed.checkpoint import ds_to_universal  # after the engine's import set-up
        tag = os.path.join(ck, "iter_0000002")
        ds_to_universal.main(argparse.Namespace(
            input_folder=tag, output_folder=tag + "_universal", num_extract_workers=1,
            num_merge_workers=1, keep_temp_folder=False, strict=True,
            inject_missing_state=False))
        _continues(_resume(ZERO[2] + ["--universal-checkpoint"], 1, ck), curve, _approx)


@pytest.fixture(scope="module")
def references():
    """One process, same seed, no layout flags: (curve, parameters) of each model."""
    out = {}
    for model, flags in MODELS.items():
        run = _build(flags, 1)
        out[model] = (_train(run, _iterations(model)), _params(run))
    return out


def _compare(outcomes, layouts, references) -> None:
    assert_checks_passed([outcome for outcome, _ in outcomes])
    for rank, (_, results) in enumerate(outcomes):
        for name, (model, _) in layouts.items():
            curve, params, tp, (ep_rank, ep) = results[name]
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
                    if ".mlp.experts." in pname:  # this expert-parallel rank's experts
                        want = want.chunk(ep)[ep_rank]
                    torch.testing.assert_close(value, want, rtol=tol["rtol"],
                                               atol=tol["atol"],
                                               msg=lambda m, n=pname: f"{name} {n}: {m}")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # DeepSpeed here
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
    _deepspeed_at_cp1(str(tmp_path / "ck" / "deepspeed"),
                      outcomes[0][1]["CP2 p2p learned DeepSpeed ZeRO-2"][0])


def test_cp2xdp2_and_cp2xtp2_equal_one_process(references):
    outcomes = run_distributed(_rank, 4, LAYOUTS_4, timeout=400)
    _compare(outcomes, LAYOUTS_4, references)
