"""InProcessRestart's policy in one process (a world of one gloo rank on a HashStore): which
failures it restarts, what a restart restores, when it gives up. The two-rank recovery, bit for
bit against an undisturbed run: tests/integration/test_inprocess_restart.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from app.config import InProcessRestartConfig
from app.training.resilience.inprocess import InProcessRestart
from app.training.checkpointing.saver import SaveFailed
from app.training.resilience.watchdog import PeerFailure
from app.training.state import RunState


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return SimpleNamespace(module=model, optimizer=optimizer,
                           lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5))


def _train(restart, engine, state, iterations):
    """`iterations` steps with the trainer's calls to after_iteration."""
    restart.after_iteration(engine, state)
    for _ in range(iterations):
        engine.optimizer.zero_grad()
        engine.module(torch.randn(2, 4)).square().sum().backward()
        engine.optimizer.step()
        engine.lr_scheduler.step()
        state.iteration += 1
        state.consumed_train_samples += 2
        restart.after_iteration(engine, state)


def test_a_failure_restores_the_newest_snapshot_and_its_rng(world_of_one):
    engine, seen = _engine(), {}
    restart = InProcessRestart(InProcessRestartConfig(enabled=True, barrier_timeout=5), 1.0)

    def attempt(r):
        state = r.restore(engine) or RunState()
        seen.setdefault("starts", []).append(state.iteration)
        if len(seen["starts"]) == 1:
            _train(r, engine, state, 3)
            seen["weights"] = engine.module.weight.detach().clone()
            seen["lr"] = engine.optimizer.param_groups[0]["lr"]
            seen["draw"] = torch.rand(5)  # what the RNG gives right after the snapshot
            engine.module.weight.data.add_(1.0)  # a partial iteration, abandoned
            raise RuntimeError("a bug in this rank")
        seen["restored"] = (engine.module.weight.detach().clone(),
                            engine.optimizer.param_groups[0]["lr"], torch.rand(5))
        r.after_iteration(engine, state)  # the trainer's call before its first iteration
        return state

    state = restart.run(attempt)
    assert seen["starts"] == [0, 3] and state.iteration == 3 and state.consumed_train_samples == 6
    weights, lr, draw = seen["restored"]
    assert torch.equal(weights, seen["weights"]) and lr == seen["lr"]
    assert torch.equal(draw, seen["draw"])
    assert [(h["restart"], h["resumed_at"], h["redone"]) for h in restart.history] == [(1, 3, 0)]
    assert dist.is_initialized() and restart.generation == 1


def test_a_restart_after_a_rollback_resumes_past_the_skipped_window(world_of_one):
    """Iteration 3 spikes (samples [4, 6)) and --rollback-on-spike goes back to the checkpoint
    of iteration 1, skipping samples [2, 6); a fault comes before the next snapshot. The
    restart resumes there, at iteration 1 and sample 6, not from the snapshot of iteration 2
    taken before the spike (sample 4: the spike's window read again)."""
    engine, seen = _engine(), {}
    restart = InProcessRestart(InProcessRestartConfig(enabled=True, barrier_timeout=5), 1.0)

    def attempt(r):
        state = r.restore(engine) or RunState()
        seen.setdefault("starts", []).append((state.iteration, state.consumed_train_samples))
        if len(seen["starts"]) == 1:
            _train(r, engine, state, 2)  # snapshots of iterations 1 and 2
            state.iteration, state.consumed_train_samples = 3, 6  # iteration 3 spiked
            engine.module.weight.data.fill_(0.5)  # the rollback's load of iteration 1
            state.iteration = 1
            r.after_rollback(engine, state)
            engine.module.weight.data.add_(1.0)  # a partial iteration, abandoned
            raise RuntimeError("a bug in this rank")
        return state

    restart.run(attempt)
    assert seen["starts"] == [(0, 0), (1, 6)]
    assert bool((engine.module.weight == 0.5).all())


def test_not_restarted_before_training_on_a_save_failure_or_past_the_limit(world_of_one):
    config = InProcessRestartConfig(enabled=True, max_iterations=2, barrier_timeout=5)
    calls = []

    def config_error(r):
        calls.append(1)
        raise ValueError("--bad-flag")  # before the first iteration: would fail again

    with pytest.raises(ValueError, match="--bad-flag"):
        InProcessRestart(config, 1.0).run(config_error)
    assert len(calls) == 1

    engine = _engine()

    def save_failed(r):
        _train(r, engine, RunState(), 1)
        raise SaveFailed("--save is full")

    with pytest.raises(SaveFailed):
        InProcessRestart(config, 1.0).run(save_failed)

    attempts = []

    def always_failing(r):
        attempts.append(r.restore(engine))
        _train(r, engine, RunState(), 1)
        raise RuntimeError("fails every time")

    restart = InProcessRestart(config, 1.0)
    with pytest.raises(RuntimeError, match="fails every time"):
        restart.run(always_failing)
    assert len(attempts) == 3 and restart.restarts == 2  # --inprocess-max-iterations 2


def test_a_rank_that_does_not_rejoin_ends_the_run_with_peer_failure(world_of_one):
    """A dead process cannot rejoin: after --inprocess-barrier-timeout the run ends with
    PeerFailure (exit code 4) naming it, for the launcher's restart."""
    engine = _engine()
    restart = InProcessRestart(InProcessRestartConfig(enabled=True, barrier_timeout=0.5), 1.0)

    def attempt(r):
        _train(r, engine, RunState(), 1)
        r._world_size = 2  # a second rank, killed: it never posts its arrival
        raise RuntimeError("connection closed by a dead peer")

    with pytest.raises(PeerFailure, match=r"rank\(s\) \[1\] did not rejoin within 0.5 s "
                                          r"\(--inprocess-barrier-timeout\)"):
        restart.run(attempt)
    assert PeerFailure.exit_code == 4
