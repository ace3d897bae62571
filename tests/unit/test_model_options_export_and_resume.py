"""Model options in checkpoints and exports: what the Hugging Face GPT-2 export
refuses (app.checkpoint.hf.families.gpt2), what a checkpoint's `args` records, and a resume
with other options refused with the option named (native engine, one process)."""
from __future__ import annotations

import pytest

import arguments
from app.checkpoint.hf.families.gpt2 import gpt2_export_blockers
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import model_args
from tests.harness.synthetic import build_synthetic_run

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
        "--make-vocab-size-divisible-by", "8", "--peak-flops", "1e12",
        "--distributed-backend", "gloo"]


def _cfg(*flags, world=1):
    return arguments.config_from_argv(BASE + list(flags), world, 60)


def test_gpt2_export_blockers_name_each_option():
    assert gpt2_export_blockers(_cfg().model) == []
    # what GPT-2 can express: training-only options, and GQA with one group per head
    assert gpt2_export_blockers(_cfg("--recompute-granularity", "selective",
                                     "--group-query-attention", "--num-query-groups", "4",
                                     "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     world=2).model) == []
    blockers = gpt2_export_blockers(_cfg("--position-embedding-type", "rope",
                                         "--group-query-attention", "--num-query-groups", "2",
                                         "--untie-embeddings-and-output-weights").model)
    assert len(blockers) == 3
    assert "--position-embedding-type rope" in blockers[0]
    assert "--num-query-groups 2" in blockers[1]
    assert "--untie-embeddings-and-output-weights" in blockers[2]
    assert "--position-embedding-type alibi" in gpt2_export_blockers(
        _cfg("--position-embedding-type", "alibi").model)[0]
    assert "--num-query-groups 1" in gpt2_export_blockers(_cfg("--group-query-attention").model)[0]


def test_checkpoint_args_record_the_options():
    cfg = _cfg("--position-embedding-type", "rope", "--rotary-percent", "0.5",
               "--rotary-base", "500", "--group-query-attention", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights", "--recompute-granularity", "full")
    ns = model_args.checkpoint_args_namespace(cfg, 0, 0, 0)
    assert (ns.position_embedding_type, ns.add_position_embedding,  # Megatron's: True with rope
            ns.use_rotary_position_embeddings) == ("rope", True, True)
    assert (ns.rotary_percent, ns.rotary_base) == (0.5, 500)
    assert (ns.group_query_attention, ns.num_query_groups) == (True, 2)
    assert ns.untie_embeddings_and_output_weights is True
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == (
        "full", "uniform", 1)
    plain = model_args.checkpoint_args_namespace(_cfg(), 0, 0, 0)
    assert (plain.position_embedding_type, plain.num_query_groups, plain.add_position_embedding,
            plain.untie_embeddings_and_output_weights) == ("learned_absolute", 4, True, False)


@pytest.mark.parametrize("saved, loaded, field", [
    (["--position-embedding-type", "rope"], [], "position_embedding_type"),
    (["--group-query-attention", "--num-query-groups", "2"], ["--group-query-attention"],
     "num_query_groups"),
    (["--untie-embeddings-and-output-weights"], [], "untie_embeddings_and_output_weights"),
    (["--position-embedding-type", "rope"], ["--position-embedding-type", "rope",
                                             "--rotary-base", "500"], "rotary_base"),
])
def test_resume_with_other_model_options_is_refused(tmp_path, saved, loaded, field):
    run = build_synthetic_run(_cfg(*saved), 8)
    run["engine"].save_checkpoint(str(tmp_path), 1, {"iteration": 1, "consumed_train_samples": 2,
                                                     "consumed_valid_samples": 0})
    other = build_synthetic_run(_cfg(*loaded), 8)
    with pytest.raises(ckpt.CheckpointError, match=f"saved with {field} "):
        other["engine"].load_checkpoint(str(tmp_path))
    same = build_synthetic_run(_cfg(*saved), 8)
    assert same["engine"].load_checkpoint(str(tmp_path)).iteration == 1


OPTIONS = ["--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups",
           "2", "--untie-embeddings-and-output-weights"]


def test_saved_args_give_the_same_blockers_and_the_converter_refuses(tmp_path):
    """The converter reads a checkpoint with these options whole (its weights are the model's)
    but refuses to export it to Hugging Face (naming each option); inference at the saved layout
    builds the same model from the saved args."""
    import torch
    from app.checkpoint.hf.families.gpt2 import write_hf_dir
    from app.checkpoint.param_layout import LayoutError
    from app.checkpoint.formats import detect, read
    from app.checkpoint.state import ModelCheckpoint
    from app.inference.runner import load_model
    from app.checkpoint.hf.families.gpt2 import checkpoint_args_blockers
    from app.mpu.parallel_state import ParallelState
    cfg = _cfg(*OPTIONS)
    args = model_args.checkpoint_args_namespace(cfg, 0, 0, 0)
    assert checkpoint_args_blockers(args) == gpt2_export_blockers(cfg.model)
    plain = model_args.checkpoint_args_namespace(_cfg(), 0, 0, 0)
    assert checkpoint_args_blockers(plain) == []
    run = build_synthetic_run(cfg, 8)
    run["engine"].save_checkpoint(str(tmp_path), 1, {"iteration": 1, "consumed_train_samples": 2,
                                                     "consumed_valid_samples": 0})
    whole = read(detect(str(tmp_path))).weights
    model_state = {n: p.detach() for n, p in run["model"].named_parameters()}
    assert set(whole) == set(model_state)
    assert all(torch.equal(whole[n], model_state[n]) for n in model_state)
    with pytest.raises(LayoutError, match="Hugging Face GPT-2.*--position-embedding-type rope"):
        write_hf_dir(ModelCheckpoint(args=args, weights={}), str(tmp_path / "hf"))
    loaded = load_model(detect(str(tmp_path)), ParallelState.single()).model
    ids = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    run["model"].eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, None), run["model"](ids, None))
