"""--recompute-modules and --moe-layer-recompute on our command line: the granularity and modules
they resolve to equal Megatron Core's own TransformerConfig's; Megatron's modules this project
lacks are refused naming the flag and the value; flags that change nothing are named unread;
the recompute plan counts the checkpoint calls a selective forward makes."""
import warnings

import pytest

import arguments
from app.config import recompute_plan
from app.config.unread import unread_flags

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--disable-bias-linear",
       "--moe-layer-freq", "[1,0]"]


def _cfg(*flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return arguments.config_from_argv(BASE + list(flags), 1, 64)


def _megatron(**kw):
    """Megatron Core's TransformerConfig resolution of the same settings."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kw)
    return c.recompute_granularity, c.recompute_modules


@pytest.mark.parametrize("flags, megatron", [
    ([], {}),
    (["--moe-layer-recompute"], dict(moe_layer_recompute=True)),
    (["--recompute-granularity", "selective"], dict(recompute_granularity="selective")),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe"],
     dict(recompute_granularity="selective", recompute_modules=["mlp", "moe"])),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp",
      "--moe-layer-recompute"],
     dict(recompute_granularity="selective", recompute_modules=["mlp"],
          moe_layer_recompute=True)),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe",
      "--moe-layer-recompute"],
     dict(recompute_granularity="selective", recompute_modules=["moe"],
          moe_layer_recompute=True)),
    (["--recompute-granularity", "selective", "--recompute-modules"],
     dict(recompute_granularity="selective", recompute_modules=[])),
])
def test_granularity_and_modules_are_megatrons(flags, megatron):
    m = _cfg(*MOE, *flags).model
    assert (m.recompute_granularity, m.recompute_modules) == _megatron(**megatron)


def test_moe_layer_recompute_with_full_recompute_is_refused_as_by_megatron():
    with pytest.raises(ValueError, match="Do not set --moe-layer-recompute with full"):
        _megatron(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1, moe_layer_recompute=True)
    with pytest.raises(ValueError, match="Do not set --moe-layer-recompute with full"):
        _cfg(*MOE, "--recompute-granularity", "full", "--moe-layer-recompute")
    with pytest.warns(UserWarning, match="--moe-layer-recompute is deprecated"):
        arguments.config_from_argv(BASE + MOE + ["--moe-layer-recompute"], 1, 64)


@pytest.mark.parametrize("module", ["moe_act", "layernorm", "mla_up_proj", "gdn_norm_out",
                                    "gdp_in_proj", "gdp_qkv", "mhc", "moe_layer"])
def test_modules_this_project_lacks_are_refused_by_name(module):
    with pytest.raises(ValueError, match=f"--recompute-modules {module}: "):
        _cfg(*MOE, "--recompute-granularity", "selective", "--recompute-modules", "mlp",
             module)


def test_modules_that_change_nothing_are_named_unread():
    notes = unread_flags(_cfg(*MOE, "--recompute-modules", "mlp"))
    assert any("--recompute-modules mlp is not read" in n and "selective" in n for n in notes)
    notes = unread_flags(_cfg("--moe-layer-recompute"))  # a dense model
    assert ["--recompute-modules moe has no effect: the model has no MoE layer"] == \
        [n for n in notes if "recompute" in n]
    assert not [n for n in unread_flags(_cfg(*MOE, "--moe-layer-recompute"))
                if "recompute" in n]


def test_plan_counts_the_checkpoint_calls_of_a_selective_forward():
    """Layer 0 is an MoE layer with a shared expert, layer 1 dense: the plan of both layers
    counts the layer with the most calls twice (an upper bound DeepSpeed sizes buffers by)."""
    shared = ["--moe-shared-expert-intermediate-size", "16"]
    for modules, per_layer in ((["core_attn"], 1), (["core_attn", "mlp"], 2),
                               (["moe", "mlp"], 1), (["shared_experts"], 1),
                               (["moe", "shared_experts"], 1), ([], 0)):
        cfg = _cfg(*MOE, *shared, "--recompute-granularity", "selective", "--recompute-modules",
                   *modules)
        plan = recompute_plan(cfg.model, 2)
        assert plan.modules == tuple(modules)
        assert plan.checkpointed_regions == 2 * per_layer, modules
    assert _cfg(*MOE, "--moe-layer-recompute").model.recomputes("moe")
    # hardware FLOPs: every MLP (dense and MoE) and the attention core run their forward again
    from app.training.telemetry.flops import hardware_flops_per_token, token_flops
    m = _cfg(*MOE, *shared, "--recompute-granularity", "selective", "--recompute-modules",
             "core_attn", "mlp", "moe").model
    terms = token_flops(m)
    assert hardware_flops_per_token(m, "selective") == pytest.approx(
        terms.total + (terms.core + terms.mlp) / 3, rel=1e-12)
    assert not _cfg(*MOE, "--recompute-modules", "moe").model.recomputes("moe")
