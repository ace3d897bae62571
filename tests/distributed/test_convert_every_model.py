"""Conversion of a model with every layout-changing option the trainer has (RoPE, grouped-query
attention with 2 key/value groups, untied output layer; fp32, dropout 0): saved at TP2 in the
legacy format with its optimizer, converted by the converter to torch_dist and to TP1 legacy
(--include-optimizer), each resumes at TP1 and continues the straight TP2 run's losses and grad
norms (1e-5). The Llama recipe (SwiGLU, RMSNorm, no biases, 16 channels a head) on the same
model, trained one step and saved at TP2, exports to a LlamaForCausalLM whose logits equal the
ones the TP2 ranks compute from their own files (1e-4). One spawn (2 ranks) trains both runs and
saves; the resumes and the export run here.
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
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--disable-bias-linear", "--kv-channels", "16", "--ffn-hidden-size", "48",
         "--rotary-base", "500000"]
TOKENS = [[5, 17, 2, 3, 60, 42, 7, 30, 11, 8, 1, 2], [6, 61, 62, 13, 4, 9, 0, 33, 50, 59, 10, 12]]
ITERS, SAVED_AT = 6, 3
TOL = dict(rtol=1e-5, atol=1e-5)


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, 64), 256)


def _straight_tp2_run(save_dir, llama_dir):
    """The uninterrupted TP2 run; its legacy checkpoint (with the optimizer) at SAVED_AT. The
    Llama recipe's TP2 run saved after one step, and the full-vocabulary logits of TOKENS that
    inference (app.inference.runner, each rank its own file) computes from that save."""
    import torch
    import torch.distributed as dist
    from app.inference.runner import PipelineRunner, load_model
    curves = {}

    def train_and_save():
        run = _build(TP2, dist.get_world_size())
        curves["tp2"] = _train(run, SAVED_AT)
        run["engine"].save_checkpoint(save_dir, SAVED_AT, dict(
            iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT, consumed_valid_samples=0))
        curves["tp2"] += _train(run, ITERS - SAVED_AT)

    def llama_save_and_logits():
        run = _build(TP2 + LLAMA, dist.get_world_size())
        _train(run, 1)
        run["engine"].save_checkpoint(llama_dir, 1, dict(
            iteration=1, consumed_train_samples=8, consumed_valid_samples=0))
        loaded = load_model(llama_dir, run["ps"])
        runner = PipelineRunner(loaded.model, run["ps"], 32, torch.device("cpu"))
        tokens = torch.tensor(TOKENS)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        curves["llama"] = runner.forward(tokens, positions)[..., :loaded.vocab_size]

    return (run_checks({"TP2 run and save": train_and_save,
                        "Llama TP2 save and logits": llama_save_and_logits}),
            curves.get("tp2"), curves.get("llama"))


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory):
    """(GPT-2-block TP2 save, its straight curve after SAVED_AT, Llama TP2 save, our logits)."""
    tmp = tmp_path_factory.mktemp("tp2_saves")
    save_dir, llama_dir = str(tmp / "tp2"), str(tmp / "llama_tp2")
    results = run_distributed(_straight_tp2_run, 2, save_dir, llama_dir, timeout=300)
    assert_checks_passed([outcome for outcome, _, _ in results])
    return save_dir, results[0][1][SAVED_AT:], llama_dir, results[0][2]


def test_rope_gqa_untied_tp2_converts_to_torch_dist_and_tp1_and_resumes(saved_at_tp2, tmp_path):
    import torch

    from app.checkpoint.convert import ConvertOptions, convert
    from app.training.data_loading import build_data_iterator
    save_dir, straight, _, _ = saved_at_tp2
    for output, name in (("torch_dist", "td"), ("torch", "tp1")):
        target = str(tmp_path / name)
        convert(ConvertOptions(load=save_dir, save=target, output_format=output,
                               include_optimizer=True))
        torch.manual_seed(0)
        run = _build(["--load", target], 1)
        loaded = run["engine"].load_checkpoint(target)
        assert loaded.iteration == SAVED_AT, (output, loaded)
        iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples,
                                       2, run["ps"], 0)
        got = _train(run, ITERS - SAVED_AT, iterator)
        for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, straight)):
            torch.testing.assert_close(loss, want_loss, **TOL, msg=f"{output}: loss {i}")
            torch.testing.assert_close(norm, want_norm, **TOL, msg=f"{output}: grad norm {i}")


def test_llama_saved_at_tp2_exports_to_llama_for_causal_lm_with_our_logits(saved_at_tp2, tmp_path):
    import json

    import torch
    transformers = pytest.importorskip("transformers")
    from app.checkpoint.convert import ConvertOptions, convert
    _, _, llama_dir, ours = saved_at_tp2
    convert(ConvertOptions(load=llama_dir, save=str(tmp_path / "hf"), output_format="hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_key_value_heads"], config["head_dim"],
            config["rope_theta"], config["rms_norm_eps"], config["tie_word_embeddings"],
            config["attention_bias"], config["mlp_bias"]) == (
        ["LlamaForCausalLM"], 2, 16, 500000.0, 1e-6, False, False, False)
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                                output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        theirs = model.eval()(input_ids=torch.tensor(TOKENS)).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
