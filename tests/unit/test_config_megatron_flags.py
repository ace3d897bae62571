"""Megatron's model, optimizer and loss flags on our command line: what each sets, with
Megatron's meaning (its validate_args), and the clear refusal of what makes no sense."""
import pytest

import arguments

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4"]


def _cfg(*flags, world: int = 1, vocab: int = 64):
    return arguments.config_from_argv(BASE + list(flags), world, vocab)


def test_the_flags_set_megatrons_meaning():
    # --use-rotary-position-embeddings wins over --position-embedding-type (validate_args)
    m = _cfg("--position-embedding-type", "learned_absolute", "--use-rotary-position-embeddings",
             "--no-position-embedding", "--use-mcore-models").model
    assert (m.position_embedding_type, m.add_position_embedding) == ("rope", False)
    assert m.deprecated_use_mcore_models  # accepted, no effect
    # the QKV bias: on with linear biases; alone with --disable-bias-linear --add-qkv-bias
    assert _cfg().model.qkv_bias and not _cfg("--disable-bias-linear").model.qkv_bias
    assert _cfg("--disable-bias-linear", "--add-qkv-bias").model.qkv_bias
    # --padded-vocab-size: exact rows, no padding rule
    assert _cfg().model.padded_vocab_size == 128
    assert _cfg("--padded-vocab-size", "70").model.padded_vocab_size == 70
    # --grad-reduce-in-bf16: gradients accumulate and reduce in bf16 (fp32 by default)
    assert _cfg("--bf16").precision.grads_accumulate_in_fp32
    assert not _cfg("--bf16", "--grad-reduce-in-bf16").precision.grads_accumulate_in_fp32
    o = _cfg("--decoupled-lr", "5e-4", "--min-lr", "1e-5").optimizer
    assert o.decoupled_lr_range == (5e-4, 1e-5)  # the floor defaults to --min-lr
    assert _cfg("--decoupled-lr", "5e-4", "--decoupled-min-lr",
                "4.5e-5").optimizer.decoupled_lr_range == (5e-4, 4.5e-5)
    assert _cfg().optimizer.decoupled_lr_range is None
    m = _cfg("--position-embedding-type", "rope", "--use-rope-scaling",
             "--rotary-seq-len-interpolation-factor", "2").model
    assert (m.use_rope_scaling, m.rope_scaling_factor, m.rotary_seq_len_interpolation_factor) \
        == (True, 8.0, 2)


@pytest.mark.parametrize("flags, message", [
    (["--squared-relu", "--swiglu"], "--squared-relu and --swiglu"),
    (["--no-position-embedding"], "--no-position-embedding with --position-embedding-type "
                                  "learned_absolute"),
    (["--use-rope-scaling"], "--use-rope-scaling .* applies to --position-embedding-type rope"),
    (["--position-embedding-type", "alibi", "--rotary-seq-len-interpolation-factor", "2"],
     "--rotary-seq-len-interpolation-factor"),
    (["--decoupled-lr", "1e-5", "--min-lr", "1e-4", "--lr", "1e-3"],
     "decoupled LR floor .0.0001"),
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
     "ask for bf16 and fp32 gradient reduction"),
    (["--padded-vocab-size", "60"], r"padded vocab size \(60, --padded-vocab-size"),
])
def test_refusals_name_the_flags(flags, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*flags)


def test_padded_vocab_size_must_split_over_tensor_parallel_ranks():
    with pytest.raises(ValueError, match="padded vocab size"):
        _cfg("--padded-vocab-size", "65", "--tensor-model-parallel-size", "2", world=2)
    assert _cfg("--padded-vocab-size", "66", "--tensor-model-parallel-size", "2",
                world=2).model.padded_vocab_size == 66


def test_sub_options_without_their_option_are_accepted_and_named_unread():
    """As in Megatron-LM these are accepted; the run (and --dry-run) names each as not read."""
    from app.config.unread import unread_flags
    cfg = _cfg("--position-embedding-type", "rope", "--rope-scaling-factor", "32",
               "--decoupled-min-lr", "1e-5", "--grad-reduce-in-bf16", "--use-mcore-models",
               "--tiktoken-pattern", "v2", "--vocab-size", "64", "--mock-data")
    notes = "\n".join(unread_flags(cfg))
    for flag in ("--rope-scaling-factor", "--decoupled-min-lr", "--grad-reduce-in-bf16",
                 "--use-mcore-models", "--tiktoken-pattern"):
        assert f"{flag} is not read" in notes, (flag, notes)
    assert not cfg.precision.grad_reduce_in_bf16 or not cfg.precision.bf16
    assert cfg.precision.grads_accumulate_in_fp32 is False  # fp32 weights: no half gradients
    used = _cfg("--position-embedding-type", "rope", "--use-rope-scaling",
                "--rope-scaling-factor", "32", "--decoupled-lr", "1e-3", "--decoupled-min-lr",
                "1e-5", "--bf16", "--grad-reduce-in-bf16")
    assert unread_flags(used) == []
