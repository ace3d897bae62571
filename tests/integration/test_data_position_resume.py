"""A run resumed at another data-parallel size, or with another global batch size, reads exactly
the samples the uninterrupted run reads from its checkpoint on: the sample indices every rank's
training sampler yields (tests/integration/record_samples.py) are compared per iteration, as a
multiset over the data-parallel ranks, with those of one uninterrupted run.

- uninterrupted: one process, global batch 8, iterations 1-8, checkpoints at 3 and 6;
- DP1 -> DP2: two ranks resume from its iteration 3 and read its iterations 4-8;
- DP2 -> DP1: one process resumes from the two-rank run's iteration 6 and reads 7-8;
- global batch 8 -> 16: one process resumes from iteration 3 and reads, in its iterations 4 and
  5, the uninterrupted run's 4+5 and 6+7 (the position is counted in samples).
"""
import functools
import shutil

from app.checkpoint.names import checkpoint_dir, tracker_path
from app.data import MegatronPretrainingSampler
from tests.harness.distributed import run_pretrain
from tests.harness.corpus import tiny_gpt_args
from tests.harness.record_samples import iterations_read, recording_iter

COMMON = ["--train-iters", "8", "--lr-decay-iters", "8", "--log-interval", "4",
          "--eval-iters", "0", "--num-workers", "0", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--save-interval", "3"]


def _in_process(argv, log, monkeypatch):
    """pretrain_gpt2 in this process, recording the training samples to `log`."""
    from pretrain_gpt2 import run as pretrain_run
    with monkeypatch.context() as patch:
        patch.setattr(MegatronPretrainingSampler, "__iter__", recording_iter(log))
        return pretrain_run(argv)


def _record_on_rank(prefix: str, rank: int) -> None:
    """Rank side (run_pretrain's setup): record this rank's training samples to prefix.rank."""
    MegatronPretrainingSampler.__iter__ = recording_iter(f"{prefix}.{rank}")


def _only_iteration(save_dir, iteration, to):
    """A copy of `save_dir` holding its checkpoint of `iteration` alone, named by the tracker."""
    shutil.copytree(checkpoint_dir(str(save_dir), iteration), checkpoint_dir(str(to), iteration))
    with open(tracker_path(str(to)), "w") as f:
        f.write(str(iteration))
    return str(to)


def test_resumes_at_another_data_parallel_size_or_global_batch_read_the_same_samples(
        tiny_corpus, tmp_path, monkeypatch):
    args = lambda *extra: tiny_gpt_args(tiny_corpus, tmp_path, *COMMON, *extra)  # noqa: E731
    straight_log = str(tmp_path / "straight.0")
    _in_process(args("--save", str(tmp_path / "straight")), straight_log, monkeypatch)
    straight = iterations_read([straight_log], 4, 1)
    assert sorted(straight) == list(range(1, 9))
    assert all(straight[it] == {i: 1 for i in range((it - 1) * 8, it * 8)} for it in straight)
    at3 = _only_iteration(tmp_path / "straight", 3, tmp_path / "at3")

    run_pretrain(2, args("--load", at3, "--save", str(tmp_path / "dp2ck")),
                 setup=functools.partial(_record_on_rank, str(tmp_path / "dp2")))
    dp2 = iterations_read([str(tmp_path / "dp2.0"), str(tmp_path / "dp2.1")], 2, 4)
    assert dp2 == {it: straight[it] for it in range(4, 9)}

    at6 = _only_iteration(tmp_path / "dp2ck", 6, tmp_path / "at6")
    trainer = _in_process(args("--load", at6), str(tmp_path / "dp1.0"), monkeypatch)
    assert trainer.state.iteration == 8
    assert iterations_read([str(tmp_path / "dp1.0")], 4, 7) == {7: straight[7], 8: straight[8]}

    trainer = _in_process(args("--load", at3, "--global-batch-size", "16", "--train-iters", "5"),
                          str(tmp_path / "gb16.0"), monkeypatch)
    assert (trainer.state.iteration, trainer.state.consumed_train_samples) == (5, 56)
    gb16 = iterations_read([str(tmp_path / "gb16.0")], 8, 4)
    assert gb16 == {4: straight[4] + straight[5], 5: straight[6] + straight[7]}
