"""The formulas app.config owns, against real models and hand-computed values: the parameter
count (whole model and per rank), the activation-recompute plan, the evaluations of a run and
the samples each data split must hold."""
import pytest
import torch

import arguments
from app.config import ModelConfig, recompute_plan, samples_per_split
from app.model import GPT2Model
from app.mpu import random as mpu_random
from app.mpu.parallel_state import ParallelState

V, H = 64, 48


def _model_config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=6, seq_length=10,
                max_position_embeddings=12, padded_vocab_size=V, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("options", [
    {}, dict(group_query_attention=True, num_query_groups=2),
    dict(group_query_attention=True), dict(untie_embeddings_and_output_weights=True),
    dict(position_embedding_type="rope"), dict(position_embedding_type="alibi"),
    dict(ffn_hidden_size=40, position_embedding_type="rope", group_query_attention=True,
         num_query_groups=3, untie_embeddings_and_output_weights=True),
], ids=["gpt2", "gqa2", "mqa", "untied", "rope", "alibi", "rope-gqa3-untied-ffn40"])
def test_num_parameters_counts_the_real_model(options):
    cfg = _model_config(**options)
    assert cfg.num_parameters() == _count(GPT2Model(cfg))


def test_num_parameters_of_gpt2_small_by_hand():
    """GPT-2 small (124M): 12 layers of width 768, 1024 positions, 50257 tokens unpadded."""
    cfg = ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
                      max_position_embeddings=1024, padded_vocab_size=50257)
    assert cfg.num_parameters() == 124_439_808


@pytest.mark.parametrize("tp,pp,options", [
    (2, 2, {}), (2, 1, dict(group_query_attention=True, num_query_groups=1)),
    (2, 2, dict(position_embedding_type="rope", untie_embeddings_and_output_weights=True)),
    (3, 2, dict(group_query_attention=True, num_query_groups=3, padded_vocab_size=66)),
])
def test_parameters_per_rank_counts_each_stage_shard(tp, pp, options):
    cfg = _model_config(num_layers=4, **options)
    per_stage = cfg.num_layers // pp
    for tp_rank in range(tp):
        for stage in range(pp):
            ps = ParallelState(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               tensor_model_parallel_rank=tp_rank,
                               pipeline_model_parallel_rank=stage)
            mpu_random.model_parallel_seed(1, ParallelState.single())
            model = GPT2Model(cfg, ps, pre_process=stage == 0, post_process=stage == pp - 1,
                              layer_range=(stage * per_stage, (stage + 1) * per_stage))
            assert cfg.parameters_per_rank(tp, pp, stage) == _count(model), (tp_rank, stage)
            assert sorted(cfg.parameter_numels(tp, pp, stage)) == sorted(  # ZeRO-3's pieces
                p.numel() for p in model.parameters()), (tp_rank, stage)


@pytest.mark.parametrize("flags,layers,chunks,regions", [
    ({}, 5, ((5, False),), 0),
    (dict(recompute_granularity="selective"), 5, ((5, False),), 5),
    (dict(recompute_granularity="full"), 3, ((1, True),) * 3, 3),
    (dict(recompute_granularity="full", recompute_num_layers=2), 5,
     ((2, True), (2, True), (1, True)), 3),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2), 5,
     ((1, True), (1, True), (3, False)), 2),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4), 2,
     ((1, True), (1, True)), 2),
])
def test_recompute_plan_by_hand(flags, layers, chunks, regions):
    plan = recompute_plan(_model_config(num_layers=8, **flags), layers)
    assert plan.chunks == chunks
    assert plan.checkpointed_regions == regions
    assert plan.recomputed_layers == sum(n for n, recomputed in chunks if recomputed)


def test_recompute_plan_of_a_layout_follows_the_model_chunks(monkeypatch):
    """Interleaved 1F1B: 8 layers, PP 2, 2 layers per virtual stage: block recompute of 2
    layers applies to each 2-layer model chunk, so 4 chunks x 2 layers rerun, as the model
    built for one virtual stage checkpoints them."""
    cfg = arguments.config_from_argv([
        "--num-layers", "8", "--hidden-size", "48", "--num-attention-heads", "6",
        "--seq-length", "10", "--train-iters", "1", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "2", "--recompute-granularity", "full",
        "--recompute-method", "block", "--recompute-num-layers", "2",
        "--distributed-backend", "gloo"], 2, V)
    plan = cfg.recompute_plan()
    assert plan.chunks == ((1, True), (1, True))
    assert cfg.model.recomputed_layers(2, cfg.virtual_pipeline_model_parallel_size) == 8
    calls = []
    monkeypatch.setattr(mpu_random, "checkpoint", lambda fn, hidden, **_: calls.append(fn) or
                        fn(hidden))
    ps = ParallelState(pipeline_model_parallel_size=2, pipeline_model_parallel_rank=1)
    model = GPT2Model(cfg.model, ps, pre_process=False, post_process=False,
                      layer_range=(2, 4)).train()
    model.set_input_tensor(torch.randn(1, 10, 48, requires_grad=True))
    model(None, None)
    assert [len(fn.layers) for fn in calls] == [1, 1] and len(calls) == plan.checkpointed_regions


@pytest.mark.parametrize("train_iters,interval,start,expected", [
    (10, 5, 0, 2),    # at 5 and 10; the end has just evaluated
    (12, 5, 0, 3),    # at 5, 10 and the end (12)
    (3, 5, 0, 1),     # the end only
    (12, 5, 7, 2),    # resumed at 7: at 10 and the end
    (10, 5, 10, 0),   # resumed at the end, which evaluated before it saved
    (12, 5, 12, 1),   # resumed at the end of a run stopped before its final evaluation
])
def test_evaluations_by_hand(train_iters, interval, start, expected):
    cfg = arguments.config_from_argv([
        "--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "6",
        "--seq-length", "10", "--micro-batch-size", "1", "--train-iters", str(train_iters),
        "--eval-interval", str(interval), "--eval-iters", "3", "--distributed-backend",
        "gloo"], 1, V)
    assert cfg.training.evaluations(start) == expected


def test_samples_per_split_by_hand():
    argv = ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "6",
            "--seq-length", "10", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "12", "--eval-interval", "5", "--eval-iters", "2",
            "--distributed-backend", "gloo"]
    # train 12 x 4; valid 3 evaluations (5, 10, end) x 2 x 4; test 2 x 4
    assert samples_per_split(arguments.config_from_argv(argv, 1, V)) == (48, 24, 8)
    no_eval = arguments.config_from_argv(argv + ["--eval-iters", "0"], 1, V)
    assert samples_per_split(no_eval) == (48, 0, 0)
    rollback = arguments.config_from_argv(argv + [
        "--rollback-on-spike", "--max-rollbacks", "2", "--save", "ck", "--save-interval", "3",
        "--max-consecutive-skipped-iterations", "4"], 1, V)
    # plus 2 rollbacks x (3 + 4) iterations x 4
    assert samples_per_split(rollback) == (48 + 56, 24, 8)
