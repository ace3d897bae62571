"""Megatron-LM's runtime flags around the training steps (app.training.telemetry.runtime_hooks):
--manual-gc collects exactly at Megatron's points and gives the collector back; the
torch.profiler window records Megatron's iterations; --empty-unused-memory-level does nothing
without CUDA."""
import gc
import gzip
import json

import torch

from app.config import RuntimeConfig
from app.training.telemetry.runtime_hooks import RuntimeHooks, profile_dir


def _loop(hooks, iterations, evaluate_after=()):
    """The trainer's calls: the loop, each iteration (a small matmul), evaluations."""
    with hooks.training():
        for done in range(iterations):
            with hooks.iteration(done):
                torch.ones(8, 8) @ torch.ones(8, 8)
                hooks.after_forward_backward()
            if done + 1 in evaluate_after:
                with hooks.evaluation():
                    hooks.after_forward_backward()


def test_manual_gc_collects_at_megatrons_points_and_gives_the_collector_back():
    events = []

    def record(phase, info):
        if phase == "start":
            events.append(info["generation"])
    cfg = RuntimeConfig(manual_gc=True, manual_gc_interval=2)
    hooks = RuntimeHooks(cfg, rank=0, device=torch.device("cpu"), tensorboard_dir=None)
    was_enabled = gc.isenabled()
    gc.callbacks.append(record)
    try:
        with hooks.training():
            assert not gc.isenabled()  # Python's automatic collector is off while training
            events.append("start")
            for done in range(5):
                with hooks.iteration(done):
                    pass
                events.append(f"after {done + 1}")
                if done + 1 == 3:
                    with hooks.evaluation():
                        events.append("eval")
        assert gc.isenabled() == was_enabled
    finally:
        gc.callbacks.remove(record)
    # gc.collect() at the start (2 = full), after iterations 2 and 4, full before and
    # generation 0 after the evaluation
    assert events == [2, "start", "after 1", 2, "after 2", "after 3", 2, "eval", 0, 2,
                      "after 4", "after 5"]
    events.clear()
    gc.callbacks.append(record)
    try:
        quiet = RuntimeHooks(RuntimeConfig(manual_gc=True, manual_gc_eval=False), 0,
                             torch.device("cpu"), None)
        with quiet.training(), quiet.evaluation():
            events.append("eval")
    finally:
        gc.callbacks.remove(record)
    assert events == [2, "eval"]  # --no-manual-gc-eval: nothing around the evaluation


def test_torch_profiler_records_megatrons_window(tmp_path):
    """--profile on a machine without CUDA (and --use-pytorch-profiler anywhere): iterations
    start .. end-1 (counted from 1) in {tensorboard dir}/../torch_profile/rank-R.json.gz; a
    rank outside --profile-ranks writes nothing."""
    tb = tmp_path / "runs" / "tb"
    cfg = RuntimeConfig(profile=True, profile_step_start=2, profile_step_end=4,
                        profile_ranks=[0])
    logged = []
    _loop(RuntimeHooks(cfg, 0, torch.device("cpu"), str(tb), log=logged.append), 6)
    trace = tmp_path / "runs" / "torch_profile" / "rank-0.json.gz"
    assert profile_dir(str(tb)) == str(tmp_path / "runs" / "torch_profile")
    with gzip.open(trace, "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {n for n in names if n and n.startswith("iteration ")} == {"iteration 2",
                                                                        "iteration 3"}
    assert any("no nsys" in line for line in logged)
    _loop(RuntimeHooks(cfg, 1, torch.device("cpu"), str(tmp_path / "other" / "tb")), 6)
    assert not (tmp_path / "other" / "torch_profile").exists()


def test_empty_cache_is_a_cuda_call_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    _loop(RuntimeHooks(RuntimeConfig(empty_unused_memory_level=2), 0, torch.device("cpu"),
                       None), 3, evaluate_after=(2,))
    assert calls == []
    hooks = RuntimeHooks(RuntimeConfig(empty_unused_memory_level=2), 0, torch.device("cpu"),
                         None)
    hooks.cuda = True  # what a CUDA device does: level 1 after each forward-backward and
    _loop(hooks, 3, evaluate_after=(2,))  # evaluation step, level 2 also after each iteration
    assert len(calls) == 3 + 1 + 3
