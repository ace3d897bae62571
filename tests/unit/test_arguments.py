"""arguments.py: flag aliases, derived defaults, cross-flag validation, the error exit."""
import sys

import pytest

import arguments
from tests.harness.arguments import BASE, DS_JSON, build, expect_error

@pytest.mark.parametrize("old, new, dest, value", [
    ("--model-parallel-size", "--tensor-model-parallel-size", "tensor_model_parallel_size", "2"),
    ("--batch-size", "--micro-batch-size", "micro_batch_size", "3"),
    ("--intermediate-size", "--ffn-hidden-size", "ffn_hidden_size", "96"),
    ("--warmup", "--lr-warmup-fraction", "lr_warmup_fraction", "0.25"),
    ("--min-scale", "--min-loss-scale", "min_loss_scale", "4"),
    ("--local_rank", "--local-rank", "local_rank", "1"),
])
def test_alias_pairs_set_the_same_value(old, new, dest, value):
    a = arguments.parse_args([old, value])
    b = arguments.parse_args([new, value])
    assert getattr(a, dest) == getattr(b, dest) == type(getattr(a, dest))(value)
    assert vars(a) == vars(b)


def test_aliases_reach_the_config_identically():
    old = build(["--model-parallel-size", "2", "--batch-size", "1", "--intermediate-size", "128",
                 "--warmup", "0.1"], world_size=4)
    new = build(["--tensor-model-parallel-size", "2", "--micro-batch-size", "1",
                 "--ffn-hidden-size", "128", "--lr-warmup-fraction", "0.1"], world_size=4)
    assert old == new
    assert old.parallel.tensor_model_parallel_size == 2
    assert old.training.micro_batch_size == 1
    assert old.model.ffn_hidden_size == 128
    assert old.optimizer.lr_warmup_iters == 10


def test_derived_defaults():
    cfg = build(["--micro-batch-size", "3", "--warmup", "0.1", "--lr-decay-iters", "50"],
                world_size=2)
    assert cfg.model.ffn_hidden_size == 4 * 64
    assert cfg.optimizer.lr_decay_iters == 50
    assert cfg.optimizer.lr_warmup_iters == 5            # 0.1 x 50 decay iterations
    assert cfg.training.global_batch_size == 3 * 2       # micro x data-parallel size
    cfg = build(["--lr-warmup-iters", "7"])
    assert cfg.optimizer.lr_decay_iters == 100           # = --train-iters
    assert cfg.optimizer.lr_warmup_iters == 7
    args = arguments.parse_args(["--seq-length", "48", "--train-iters", "1",
                                 "--num-layers", "2", "--hidden-size", "32",
                                 "--num-attention-heads", "2"])
    cfg = arguments.build_run_config(args, 1, 50, 64)
    assert cfg.model.max_position_embeddings == 48       # defaults to --seq-length
    assert cfg.raw_vocab_size == 50 and cfg.model.padded_vocab_size == 64
    assert cfg.parallel.distributed_backend in ("gloo", "nccl")


def test_every_model_and_training_flag_is_accepted_and_converted():
    argv = BASE + [
        "--ffn-hidden-size", "128", "--hidden-dropout", "0.0", "--attention-dropout", "0.05",
        "--layernorm-epsilon", "1e-6", "--init-method-std", "0.01",
        "--make-vocab-size-divisible-by", "64", "--openai-gelu",
        "--global-batch-size", "8", "--lr", "3e-4", "--min-lr", "1e-5",
        "--lr-decay-style", "cosine", "--lr-decay-iters", "80", "--lr-warmup-iters", "4",
        "--weight-decay", "0.1", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
        "--adam-eps", "1e-6", "--clip-grad", "0.5", "--seed", "7",
        "--data-path", "0.3", "a", "0.7", "b", "--split", "90,5,5", "--data-cache-path", "c",
        "--vocab-file", "v.json", "--merge-file", "m.txt", "--tokenizer-type", "GPT2BPETokenizer",
        "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--num-workers", "0",
        "--log-interval", "5", "--eval-interval", "20", "--eval-iters", "3",
        "--tensorboard-dir", "tb", "--metrics-file", "m.jsonl",
        "--save", "ck", "--save-interval", "10", "--load", "ck", "--no-save-optim",
        "--no-save-rng", "--no-load-optim", "--no-load-rng", "--finetune",
        "--exit-interval", "50", "--exit-duration-in-mins", "1.5",
        "--pipeline-model-parallel-size", "2", "--checkpoint-activations",
        "--checkpoint-num-layers", "2", "--no-bias-gelu-fusion", "--no-masked-softmax-fusion",
        "--peak-flops", "1e12", "--keep-last-n-checkpoints", "2",
    ]
    cfg = arguments.build_run_config(arguments.parse_args(argv), 2, 100, 128)
    m, o, d, t, c, p = (cfg.model, cfg.optimizer, cfg.data, cfg.training, cfg.checkpoint,
                        cfg.precision)
    assert (m.ffn_hidden_size, m.hidden_dropout, m.attention_dropout) == (128, 0.0, 0.05)
    assert (m.layernorm_epsilon, m.init_method_std, m.openai_gelu) == (1e-6, 0.01, True)
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full", "uniform", 2)
    assert (m.bias_gelu_fusion, m.masked_softmax_fusion, m.params_dtype) == (False, False,
                                                                             "float32")
    assert cfg.make_vocab_size_divisible_by == 64
    assert (o.lr, o.min_lr, o.lr_decay_style, o.lr_decay_iters, o.lr_warmup_iters) == (
        3e-4, 1e-5, "cosine", 80, 4)
    assert (o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps, o.clip_grad) == (
        0.1, 0.8, 0.95, 1e-6, 0.5)
    assert d.data_path == ["0.3", "a", "0.7", "b"] and d.split == "90,5,5"
    assert (d.data_cache_path, d.vocab_file, d.merge_file) == ("c", "v.json", "m.txt")
    assert (d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss) == (True,) * 3
    assert d.num_workers == 0
    assert (t.global_batch_size, t.seed, t.log_interval, t.eval_interval, t.eval_iters) == (
        8, 7, 5, 20, 3)
    assert (t.tensorboard_dir, t.metrics_file, t.peak_flops) == ("tb", "m.jsonl", 1e12)
    assert (t.exit_interval, t.exit_duration_in_mins) == (50, 1.5)
    assert (c.save, c.save_interval, c.load, c.keep_last_n_checkpoints) == ("ck", 10, "ck", 2)
    assert c.no_save_optim and c.no_save_rng and c.no_load_optim and c.no_load_rng
    assert c.finetune
    assert cfg.parallel.pipeline_model_parallel_size == 2
    assert not p.fp16 and m.params_dtype == "float32"


def test_precision_flags_on_deepspeed_and_native(tmp_path):
    import json
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8}))
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--train-iters", "10", "--micro-batch-size", "2"]
    half = ["--fp16", "--loss-scale", "128", "--initial-loss-scale", "1024",
            "--loss-scale-window", "10", "--hysteresis", "3"]
    cfg = arguments.build_run_config(arguments.parse_args(
        base + half + ["--deepspeed", "--deepspeed_config", str(ds)]), 2, 100, 128)
    p = cfg.precision
    assert (p.fp16, p.loss_scale, p.initial_loss_scale, p.loss_scale_window, p.hysteresis) == (
        True, 128.0, 1024.0, 10, 3)
    assert cfg.model.params_dtype == "float16"
    assert cfg.training.global_batch_size == 8  # taken from the JSON's train_batch_size
    native = arguments.build_run_config(arguments.parse_args(base + ["--bf16"]), 2, 100, 128)
    assert native.model.params_dtype == "bfloat16" and native.precision.grads_accumulate_in_fp32
    assert native.precision.dynamic_scaler_settings() == (2.0 ** 32, 1.0, 1000, 2)  # Megatron's
    fp16 = arguments.build_run_config(arguments.parse_args(base + half), 1, 100, 128)
    assert fp16.model.params_dtype == "float16" and not fp16.precision.grads_accumulate_in_fp32
    bf16 = arguments.build_run_config(arguments.parse_args(base + ["--bf16", "--hysteresis", "3"]),
                                      1, 100, 128)  # accepted, as Megatron-LM does; not read
    assert bf16.precision.loss_scale_flags == ["--hysteresis"]
    with pytest.raises(ValueError, match="--fp16-lm-cross-entropy"):
        arguments.build_run_config(arguments.parse_args(base + ["--fp16-lm-cross-entropy"]),
                                   1, 100, 128)


def test_deepspeed_json_decides_the_precision_unless_a_flag_contradicts_it(tmp_path):
    import json
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--train-iters", "10", "--micro-batch-size", "2"]
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({key: {"enabled": True}}))
        ds = base + ["--deepspeed", "--deepspeed_config", str(path)]
        cfg = arguments.build_run_config(arguments.parse_args(ds), 1, 100, 128)
        assert cfg.model.params_dtype == dtype and str(path) in cfg.precision.source
        assert cfg.deepspeed.config[key]["enabled"] is True
        other = "--fp16" if key == "bf16" else "--bf16"
        with pytest.raises(ValueError) as err:
            arguments.build_run_config(arguments.parse_args(ds + [other]), 1, 100, 128)
        assert f"{key}.enabled" in str(err.value) and other in str(err.value)
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    cfg = arguments.build_run_config(arguments.parse_args(
        base + ["--bf16", "--deepspeed", "--deepspeed_config", str(plain)]), 1, 100, 128)
    assert cfg.deepspeed.config["bf16"]["enabled"] is True and cfg.precision.bf16


def test_deepspeed_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the JSON files are read when the config is built
    for name in ("ds.json", "old.json"):
        (tmp_path / name).write_text("{}")
    cfg = build(["--deepspeed", "--deepspeed_config", "ds.json", "--deepspeed_mpi",
                 "--deepspeed-activation-checkpointing", "--recompute-granularity", "selective"])
    assert cfg.deepspeed.enabled and cfg.deepspeed.config_path == "ds.json"
    assert cfg.deepspeed.mpi and cfg.deepspeed.activation_checkpointing
    cfg = build(["--deepscale", "--deepscale_config", "old.json"])
    assert cfg.deepspeed.enabled and cfg.deepspeed.config_path == "old.json"


def test_deepspeed_flags_without_deepspeed_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    args = arguments.parse_args(["--deepspeed", "--deepspeed_config", "x.json",
                                 "--deepspeed_mpi", "--deepscale"])
    assert args.deepspeed and args.deepspeed_config == "x.json" and args.deepspeed_mpi


@pytest.mark.parametrize("argv", [[], ["--deepspeed", "--deepspeed_config", "x.json"],
                                  ["--deepscale", "--deepscale_config", "y.json"]])
def test_deepspeeds_flag_definitions_and_ours_parse_alike(argv):
    """A command line naming no DeepSpeed flag is parsed with our copy of DeepSpeed's four flags
    (no import of deepspeed); the copy must give what DeepSpeed's own definitions give."""
    theirs = arguments.build_parser(deepspeed_flags_from_deepspeed=True).parse_args(argv)
    ours = arguments.build_parser(deepspeed_flags_from_deepspeed=False).parse_args(argv)
    assert vars(theirs) == vars(ours)


def test_a_native_run_starts_without_deepspeed_or_torch_dcp():
    """A native command line is parsed, listed and handed to the trainer's modules without
    importing deepspeed or torch.distributed.checkpoint (together ~1.3 s of every rank's start on
    a CPU); --deepspeed still gets DeepSpeed's own flag definitions."""
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, arguments, pretrain_gpt2\n"
            "arguments.format_args(arguments.parse_args(['--num-layers', '2']))\n"
            "heavy = [m for m in ('deepspeed', 'torch.distributed.checkpoint') if m in sys.modules]\n"
            "arguments.parse_args(['--deepspeed'])\n"
            "sys.exit(f'imported at start: {heavy}' if heavy else 0 if 'deepspeed' in sys.modules "
            "else 'deepspeed not imported for --deepspeed')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("extra, world, fragments", [
    (["--hidden-size", "66"], 1, ["--hidden-size (66)", "--num-attention-heads (4)"]),
    (["--global-batch-size", "12", "--micro-batch-size", "4"], 2,
     ["--global-batch-size (12)", "--micro-batch-size (4)", "data-parallel size (2)"]),
    (["--seq-length", "128"], 1, ["--seq-length (128)", "--max-position-embeddings (64)"]),
    (["--tensor-model-parallel-size", "3"], 6,
     ["--num-attention-heads (4)", "--tensor-model-parallel-size (3)"]),
    (["--tensor-model-parallel-size", "2"], 3,
     ["world size (3)", "--tensor-model-parallel-size (2)", "--pipeline-model-parallel-size (1)"]),
    (["--pipeline-model-parallel-size", "3"], 3,
     ["--num-layers (4)", "--pipeline-model-parallel-size (3)"]),
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "99"], 2,
     ["--ffn-hidden-size (99)", "--tensor-model-parallel-size (2)"]),
    (["--warmup", "0.1", "--lr-warmup-iters", "5"], 1,
     ["--lr-warmup-fraction/--warmup (0.1)", "--lr-warmup-iters (5)"]),
    (["--lr-warmup-iters", "200"], 1, ["warmup iterations (200)", "--lr-decay-iters (100)"]),
    (["--lr", "1e-4", "--min-lr", "1e-3"], 1, ["--min-lr (0.001)", "--lr (0.0001)"]),
    (["--fp16", "--bf16"], 1, ["--fp16", "--bf16"]),
    (["--deepspeed"], 1, ["--deepspeed", "--deepspeed_config"]),
    (["--deepspeed", "--deepspeed_config", DS_JSON.replace("zero1", "zero2"),
      "--pipeline-model-parallel-size", "2"], 2,
     ["--pipeline-model-parallel-size (2)", "--deepspeed", "zero_optimization.stage 2"]),
    (["--finetune"], 1, ["--finetune", "--load"]),
    (["--split", "a,b"], 1, ["--split", "a,b"]),
    (["--split", "1e2,1,1"], 1, ["--split", "1e2,1,1", "without exponents"]),
    (["--split", "9,1,0,1"], 1, ["--split", "9,1,0,1", "up to three"]),
    (["--hidden-dropout", "1.5"], 1, ["--hidden-dropout", "1.5"]),
    (["--save-interval", "0"], 1, ["--save-interval", "0"]),
    (["--keep-last-n-checkpoints", "0"], 1, ["--keep-last-n-checkpoints", "0"]),
    (["--micro-batch-size", "0"], 1, ["--micro-batch-size", "0"]),
    # sequence parallelism, recompute, positions, query groups
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33"], 2,
     ["--seq-length (33)", "--tensor-model-parallel-size (2)"]),
    (["--recompute-method", "block"], 1, ["--recompute-method", "--recompute-granularity full"]),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], 1,
     ["--recompute-num-layers", "selective", "--recompute-granularity full"]),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     ["--recompute-num-layers (3)", "layers per pipeline stage (2", "--num-layers 4"]),
    (["--checkpoint-activations", "--recompute-granularity", "selective"], 1,
     ["--checkpoint-activations", "--recompute-granularity selective"]),
    (["--checkpoint-activations", "--checkpoint-num-layers", "2", "--recompute-num-layers", "1"],
     1, ["--checkpoint-activations", "--recompute-num-layers 1"]),
    (["--deepspeed-activation-checkpointing"], 1, ["--deepspeed-activation-checkpointing",
                                                   "--deepspeed"]),
    (["--deepspeed", "--deepspeed_config", DS_JSON, "--deepspeed-activation-checkpointing"], 1,
     ["--deepspeed-activation-checkpointing", "--recompute-granularity"]),
    (["--rotary-percent", "0.5"], 1, ["--rotary-percent (0.5)", "learned_absolute",
                                      "--position-embedding-type rope"]),
    (["--position-embedding-type", "alibi", "--rotary-base", "500"], 1,
     ["--rotary-base (500)", "alibi"]),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.1"], 1,
     ["--rotary-percent (0.1)", "1 rotated", "even"]),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], 1,
     ["--rotary-percent", "(0, 1]"]),
    (["--position-embedding-type", "alibi", "--use-flash-attn"], 1,
     ["alibi", "--use-flash-attn", "--attention-backend auto"]),
    (["--position-embedding-type", "alibi", "--attention-backend", "local"], 1,
     ["alibi", "--attention-backend local", "--attention-backend auto"]),
    (["--num-query-groups", "2"], 1, ["--num-query-groups (2)", "--group-query-attention"]),
    (["--group-query-attention", "--num-query-groups", "3"], 1,
     ["--num-attention-heads (4)", "--num-query-groups (3)"]),
    (["--group-query-attention", "--num-query-groups", "2", "--num-attention-heads", "8",
      "--tensor-model-parallel-size", "8", "--ffn-hidden-size", "256", "--hidden-size", "128"],
     8, []),  # 2 groups at TP 8: each group replicated on 4 ranks, accepted (checked below)
    (["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2",
      "--deepspeed", "--deepspeed_config", DS_JSON], 2,
     ["--num-query-groups (1)", "--tensor-model-parallel-size (2)", "--deepspeed"]),
])
def test_cross_flag_rules_name_the_values(extra, world, fragments):
    if not fragments:
        build(extra, world_size=world)
        return
    expect_error(extra, *fragments, world_size=world)


def test_padded_vocab_and_train_iters_rules():
    expect_error(["--tensor-model-parallel-size", "4"], "padded vocab size (130)",
                 "--tensor-model-parallel-size (4)", world_size=4, padded_vocab=130)
    args = arguments.parse_args(["--num-layers", "2"])
    with pytest.raises(ValueError, match="--train-iters is required"):
        arguments.build_run_config(args, 1, 100, 128)


def test_nccl_without_cuda_is_refused(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build([]).parallel.distributed_backend == "gloo"
    assert arguments.parse_args([]).distributed_backend == "gloo"  # resolved at parse time
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert arguments.parse_args([]).distributed_backend == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    expect_error(["--distributed-backend", "nccl"], "nccl", "gloo")


def test_recompute_spellings_and_groups_against_tp():
    """--checkpoint-activations is --recompute-granularity full --recompute-method uniform;
    query groups must split over TP or TP over them."""
    old = build(["--checkpoint-activations", "--checkpoint-num-layers", "2"]).model
    new = build(["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "2"]).model
    assert old == new and (old.recompute_granularity, old.recompute_method,
                           old.recompute_num_layers) == ("full", "uniform", 2)
    bare = build(["--recompute-granularity", "full"]).model
    assert (bare.recompute_method, bare.recompute_num_layers) == ("uniform", 1)
    assert build(["--checkpoint-num-layers", "3"]).model.recompute_granularity is None
    assert build(["--group-query-attention"]).model.num_kv_heads == 1  # Megatron's default
    expect_error(["--group-query-attention", "--num-query-groups", "6", "--num-attention-heads",
                  "12", "--hidden-size", "96", "--tensor-model-parallel-size", "4",
                  "--ffn-hidden-size", "384"],
                 "--num-query-groups (6)", "--tensor-model-parallel-size (4)", world_size=4)


def test_compile_layers_is_off_by_default_and_refused_with_deepspeed():
    assert build([]).kernels.compile_layers is False
    assert build(["--compile-layers"]).kernels.compile_layers is True
    expect_error(["--compile-layers", "--deepspeed", "--deepspeed_config", DS_JSON],
                 "--compile-layers is for the native path", "drop --compile-layers or --deepspeed")
