"""Megatron LR schedule: hand-computed values per decay style, warmup edges, state round trip."""
import math

import pytest
import torch

from app.config import OptimizerConfig
from app.optim.lr_schedule import OptimizerParamScheduler, learning_rate_at


def _sched(style: str, lr=1.0, min_lr=0.1, warmup=10, decay=110):
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [param]}, {"params": [], "lr_mult": 0.5}], lr=123.0)
    cfg = OptimizerConfig(lr=lr, min_lr=min_lr, lr_decay_style=style, lr_decay_iters=decay,
                          lr_warmup_iters=warmup)
    return OptimizerParamScheduler(opt, cfg), opt


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "exponential"])
def test_warmup_is_linear_from_zero(style):
    sched, _ = _sched(style)
    assert sched.get_lr(0) == 0.0
    assert sched.get_lr(1) == pytest.approx(0.1)
    assert sched.get_lr(5) == pytest.approx(0.5)
    assert sched.get_lr(10) == pytest.approx(1.0)  # boundary: still the warmup formula, = lr


def test_linear_values():
    sched, _ = _sched("linear")
    # r = (t - 10) / 100; lr = 0.1 + 0.9 (1 - r)
    assert sched.get_lr(11) == pytest.approx(0.1 + 0.9 * 0.99)
    assert sched.get_lr(60) == pytest.approx(0.55)
    assert sched.get_lr(110) == pytest.approx(0.1)
    assert sched.get_lr(111) == 0.1
    assert sched.get_lr(10_000) == 0.1


def test_cosine_values():
    sched, _ = _sched("cosine")
    assert sched.get_lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert sched.get_lr(60) == pytest.approx(0.55)
    assert sched.get_lr(110) == pytest.approx(0.1)
    assert sched.get_lr(500) == 0.1


def test_exponential_values():
    sched, _ = _sched("exponential", min_lr=0.0)
    assert sched.get_lr(60) == pytest.approx(2 ** -0.5)
    assert sched.get_lr(110) == pytest.approx(0.5)
    assert sched.get_lr(1000) == pytest.approx(0.5)  # holds its end value, no jump
    floored, _ = _sched("exponential", min_lr=0.8)
    assert floored.get_lr(110) == pytest.approx(0.8)


def test_constant_and_no_warmup():
    sched, _ = _sched("constant", warmup=0)
    assert [sched.get_lr(t) for t in (0, 1, 500)] == [1.0, 1.0, 1.0]
    assert learning_rate_at(0, lr=2.0, min_lr=0.0, warmup_iters=0, decay_iters=4,
                            decay_style="linear") == 2.0
    assert learning_rate_at(2, lr=2.0, min_lr=0.0, warmup_iters=0, decay_iters=4,
                            decay_style="linear") == 1.0


def test_step_writes_lr_into_param_groups_and_get_lr_is_pure():
    sched, opt = _sched("linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # constructor wrote get_lr(0)
    sched.get_lr(60)
    assert sched.num_steps == 0
    sched.step()
    sched.step(4)
    assert sched.num_steps == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.25)  # lr_mult


def test_state_dict_round_trip_and_mismatch():
    sched, _ = _sched("cosine")
    sched.step(42)
    state = sched.state_dict()
    assert state["num_steps"] == 42 and state["lr_decay_style"] == "cosine"
    fresh, opt = _sched("cosine")
    fresh.load_state_dict(state)
    assert fresh.num_steps == 42
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.get_lr(42))
    other, _ = _sched("linear")
    with pytest.raises(ValueError, match="lr_decay_style"):
        other.load_state_dict(state)
    other.load_state_dict(state, override=True)
    assert other.lr_decay_style == "linear" and other.num_steps == 42
    legacy, _ = _sched("cosine")
    legacy.load_state_dict({"num_iters": 7, "start_lr": 1.0})
    assert legacy.num_steps == 7


def test_missing_decay_iters_is_explained():
    with pytest.raises(ValueError, match="lr-decay-iters"):
        OptimizerParamScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                                OptimizerConfig(lr_decay_style="cosine", lr_decay_iters=None))


def _hand_lr(step: int, peak: float, floor: float, warmup: int = 2, decay: int = 6) -> float:
    """Megatron's warm-up then cosine decay, written out (optimizer_param_scheduler.get_lr)."""
    if step <= warmup:
        return peak * step / warmup
    ratio = (step - warmup) / (decay - warmup)
    return floor + (peak - floor) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_decoupled_lr_moves_embeddings_and_output_layer_on_their_own_schedule():
    """--decoupled-lr: SGD steps (no momentum, decay or clipping) move the word embeddings and
    the untied output layer by their own LR x gradient, every other parameter (the position
    table too) by the ordinary LR, each LR from the schedule formula by hand; the logged LR is
    the ordinary one."""
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "8", "--optimizer", "sgd", "--sgd-momentum", "0",
            "--weight-decay", "0", "--clip-grad", "0", "--lr", "0.1", "--min-lr", "0.01",
            "--decoupled-lr", "0.5", "--decoupled-min-lr", "0.05", "--lr-warmup-iters", "2",
            "--lr-decay-style", "cosine", "--untie-embeddings-and-output-weights"]
    run = build_synthetic_run(arguments.config_from_argv(argv, 1, 60), 12)
    params = dict(run["model"].named_parameters())
    decoupled = {"language_model.embedding.word_embeddings.weight",
                 "language_model.output_layer.weight"}
    assert [g["name"] for g in run["engine"].optimizer.param_groups][-1] == "decoupled"
    for step in range(5):
        before = {n: p.detach().clone() for n, p in params.items()}
        out = run["trainer"].train_step(run["iterator"])
        assert out.lr == pytest.approx(_hand_lr(step, 0.1, 0.01))
        for name, p in params.items():
            lr = _hand_lr(step, 0.5, 0.05) if name in decoupled else _hand_lr(step, 0.1, 0.01)
            torch.testing.assert_close(before[name] - p.detach(), lr * p.grad, rtol=1e-4,
                                       atol=1e-7, msg=lambda m, n=name: f"step {step} {n}: {m}")
    state = run["engine"].lr_scheduler.state_dict()
    assert (state["decoupled_lr"], state["decoupled_min_lr"]) == (0.5, 0.05)
    other = arguments.config_from_argv([a if a != "0.5" else "0.4" for a in argv], 1, 60)
    sched = OptimizerParamScheduler(run["engine"].optimizer, other.optimizer)
    with pytest.raises(ValueError, match="--decoupled-lr/--decoupled-min-lr"):
        sched.load_state_dict(state)
