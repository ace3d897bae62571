"""Conversion of a model with every layout-changing option the trainer has (RoPE, grouped-query
attention with 2 key/value groups, untied output layer; fp32, dropout 0), and of the Llama
block on top of them (--swiglu, RMSNorm, no biases, --qk-layernorm): saved at TP2 in the legacy
format with its optimizer, converted by the converter (--include-optimizer) to torch_dist and
to TP1 legacy (the Llama model: torch_dist, then that torch_dist back to TP1 legacy), each
resumes at TP1 and continues the straight TP2 run's losses and grad norms (1e-5). One spawn
(2 ranks) trains both straight runs and saves; the resumes run here.
"""
from __future__ import annotations

from tests.harness.distributed import assert_checks_passed, run_checks, run_distributed
from tests.harness.synthetic import train_steps as _train

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8", "--position-embedding-type", "rope",
        "--group-query-attention", "--num-query-groups", "2",
        "--untie-embeddings-and-output-weights"]
TP2 = ["--tensor-model-parallel-size", "2"]
MODELS = {"rope-gqa-untied": [], "llama": ["--swiglu", "--normalization", "RMSNorm",
                                           "--disable-bias-linear", "--qk-layernorm"]}
"""Each model's flags on top of ARGV."""
ITERS, SAVED_AT = 6, 3
TOL = dict(rtol=1e-5, atol=1e-5)


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, 64), 256)


def _straight_tp2_runs(base):
    """The uninterrupted TP2 run of each model; its legacy checkpoint (with the optimizer) at
    SAVED_AT in `base`/<model>."""
    import torch.distributed as dist
    curves = {}

    def train_and_save(model):
        def check():
            run = _build(MODELS[model] + TP2, dist.get_world_size())
            curves[model] = _train(run, SAVED_AT)
            run["engine"].save_checkpoint(f"{base}/{model}", SAVED_AT, dict(
                iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT,
                consumed_valid_samples=0))
            curves[model] += _train(run, ITERS - SAVED_AT)
        return check

    return run_checks({f"{model}: TP2 run and save": train_and_save(model)
                       for model in MODELS}), curves


CONVERSIONS = {  # model: [(converted name, its source, output format)]
    "rope-gqa-untied": [("td", "tp2", "torch_dist"), ("tp1", "tp2", "torch")],
    "llama": [("td", "tp2", "torch_dist"), ("tp1", "td", "torch")],
}


def test_every_model_at_tp2_converts_to_torch_dist_and_tp1_and_resumes(tmp_path):
    import torch

    from app.checkpoint.convert import ConvertOptions, convert
    from app.training.data_loading import build_data_iterator
    results = run_distributed(_straight_tp2_runs, 2, str(tmp_path), timeout=300)
    assert_checks_passed([outcome for outcome, _ in results])
    for model, conversions in CONVERSIONS.items():
        straight = results[0][1][model][SAVED_AT:]
        folders = {"tp2": str(tmp_path / model)}
        for name, source, output in conversions:
            target = folders[name] = str(tmp_path / f"{model}-{name}")
            convert(ConvertOptions(load=folders[source], save=target, output_format=output,
                                   include_optimizer=True))
            torch.manual_seed(0)
            run = _build(MODELS[model] + ["--load", target], 1)
            loaded = run["engine"].load_checkpoint(target)
            assert loaded.iteration == SAVED_AT, (model, output, loaded)
            iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples,
                                           2, run["ps"], 0)
            got = _train(run, ITERS - SAVED_AT, iterator)
            for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, straight)):
                where = f"{model} {source} -> {name} ({output})"
                torch.testing.assert_close(loss, want_loss, **TOL, msg=f"{where}: loss {i}")
                torch.testing.assert_close(norm, want_norm, **TOL, msg=f"{where}: grad norm {i}")
