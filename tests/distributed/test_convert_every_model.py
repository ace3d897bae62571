"""Conversion of a model with every layout-changing option the trainer has (RoPE, grouped-query
attention with 2 key/value groups, untied output layer; fp32, dropout 0), and of the Llama
block on top of them (--swiglu, RMSNorm, no biases, --qk-layernorm): saved at TP2 in the legacy
format with its optimizer, converted by the converter (--include-optimizer) to torch_dist and
to TP1 legacy (the Llama model: torch_dist, then that torch_dist back to TP1 legacy), each
resumes at TP1 and continues the straight TP2 run's losses and grad norms (1e-5). The Llama
recipe as Hugging Face's Llama has it (no QK-norm; 16 channels a head, RoPE base 500000) and the
Llama block above (QK-norm: Qwen3), each saved by its TP2 run, export to LlamaForCausalLM and
Qwen3ForCausalLM whose logits equal the ones the TP2 ranks compute from their own files
(1e-4). A Mixture-of-Experts model (the Llama block with QK-norm, 4 experts top-2 after a dense
first layer) trains at EP2 instead, saves Megatron's per-expert-rank files (mp_rank_00_000,
mp_rank_00_001), converts to torch_dist and to EP1 legacy files (the experts merged), each of
which resumes at EP1 continuing the EP2 run's losses and grad norms (1e-5), and exports to
Qwen3MoeForCausalLM with the logits the EP2 ranks compute from their own files (1e-5). One
spawn (2 ranks) trains the straight runs, saves and computes those logits; the resumes and
exports run here.
"""
from __future__ import annotations

import pytest

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
LLAMA_BLOCK = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]
MODELS = {"rope-gqa-untied": [], "llama": LLAMA_BLOCK + ["--qk-layernorm"],
          "llama-hf": LLAMA_BLOCK + ["--norm-epsilon", "1e-6", "--kv-channels", "16",
                                     "--ffn-hidden-size", "48", "--rotary-base", "500000"],
          "moe": LLAMA_BLOCK + ["--qk-layernorm", "--ffn-hidden-size", "64", "--num-experts", "4",
                                "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
                                "--moe-aux-loss-coeff", "1e-2", "--moe-layer-freq", "([0]+[1]*1)"]}
"""Each model's flags on top of ARGV."""
LAYOUT_OF = {"moe": ["--expert-model-parallel-size", "2"]}
"""The 2-rank layout of each model's straight run (default TP2)."""
HF_EXPORTS = {"llama-hf": "LlamaForCausalLM", "llama": "Qwen3ForCausalLM",
              "moe": "Qwen3MoeForCausalLM"}
"""The models exported to Hugging Face, and the class each loads as."""
TOKENS = [[5, 17, 2, 3, 60, 42, 7, 30, 11, 8, 1, 2], [6, 61, 62, 13, 4, 9, 0, 33, 50, 59, 10, 12]]
ITERS, SAVED_AT = 6, 3
TOL = dict(rtol=1e-5, atol=1e-5)


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, 64), 256)


def _straight_tp2_runs(base):
    """The uninterrupted TP2 run of each model; its legacy checkpoint (with the optimizer) at
    SAVED_AT in `base`/<model>; for HF_EXPORTS, the full-vocabulary logits of TOKENS that
    inference (app.inference.runner, each rank its own file) computes from that save."""
    import torch
    import torch.distributed as dist
    from app.checkpoint.formats import detect
    from app.inference.runner import PipelineRunner, load_model
    curves, logits = {}, {}

    def logits_of(folder, ps):
        loaded = load_model(detect(folder), ps)
        runner = PipelineRunner(loaded.model, ps, 32, torch.device("cpu"))
        tokens = torch.tensor(TOKENS)
        return runner.forward(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))

    def train_and_save(model):
        def check():
            run = _build(MODELS[model] + LAYOUT_OF.get(model, TP2), dist.get_world_size())
            curves[model] = _train(run, SAVED_AT)
            run["engine"].save_checkpoint(f"{base}/{model}", SAVED_AT, dict(
                iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT,
                consumed_valid_samples=0))
            curves[model] += _train(run, ITERS - SAVED_AT)
            if model in HF_EXPORTS:
                logits[model] = logits_of(f"{base}/{model}", run["ps"])[..., :64]
        return check

    return run_checks({f"{model}: TP2 run and save": train_and_save(model)
                       for model in MODELS}), curves, logits


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory):
    """(folder holding each model's TP2 save, curves, our logits of the HF_EXPORTS)."""
    base = tmp_path_factory.mktemp("tp2_saves")
    results = run_distributed(_straight_tp2_runs, 2, str(base), timeout=300)
    assert_checks_passed([outcome for outcome, _, _ in results])
    return base, results[0][1], results[0][2]


CONVERSIONS = {  # model: [(converted name, its source, output format)]
    "rope-gqa-untied": [("td", "tp2", "torch_dist"), ("tp1", "tp2", "torch")],
    "llama": [("td", "tp2", "torch_dist"), ("tp1", "td", "torch")],
    "moe": [("td", "tp2", "torch_dist"), ("tp1", "tp2", "torch")],  # "tp2": its EP2 save
}


def test_every_model_at_tp2_converts_to_torch_dist_and_tp1_and_resumes(saved_at_tp2, tmp_path):
    import torch

    from app.checkpoint.convert import ConvertOptions, convert
    from app.training.data_loading import build_data_iterator
    base, curves, _ = saved_at_tp2
    for model, conversions in CONVERSIONS.items():
        straight = curves[model][SAVED_AT:]
        folders = {"tp2": str(base / model)}
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


@pytest.mark.parametrize("model", HF_EXPORTS)
def test_llama_saved_at_tp2_exports_to_hugging_face_with_our_logits(saved_at_tp2, tmp_path, model):
    import json

    import torch
    transformers = pytest.importorskip("transformers")
    from app.checkpoint.convert import ConvertOptions, convert
    base, _, ours = saved_at_tp2
    convert(ConvertOptions(load=str(base / model), save=str(tmp_path / "hf"), output_format="hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    head_dim, theta, eps = (16, 500000.0, 1e-6) if model == "llama-hf" else (8, 10000.0, 1e-5)
    assert (config["architectures"], config["num_key_value_heads"], config["head_dim"],
            config["rope_theta"], config["rms_norm_eps"], config["tie_word_embeddings"],
            config["attention_bias"]) == ([HF_EXPORTS[model]], 2, head_dim, theta, eps, False,
                                          False)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                                 output_loading_info=True)
    assert type(hf).__name__ == HF_EXPORTS[model]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        theirs = hf.eval()(input_ids=torch.tensor(TOKENS)).logits
    tol = 1e-5 if model == "moe" else 1e-4
    torch.testing.assert_close(theirs, ours[model], rtol=tol, atol=tol)
