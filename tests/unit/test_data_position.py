"""Where the data resumes: MegatronPretrainingSampler, started at a checkpoint's
consumed_train_samples, gives the iterations after it exactly the samples (as a multiset over all
data-parallel ranks) that an uninterrupted run gives them, whatever the data-parallel and
micro-batch sizes of either run; with another global batch size it continues the uninterrupted
run's sample stream without a gap or a repeat. The end-to-end resumes through pretrain_gpt2.py
are tests/integration/test_data_position.py."""
import itertools
from collections import Counter

import pytest

from app.data import MegatronPretrainingSampler

TOTAL = 400


def iterations_consumed(consumed, micro, dp, global_batch, iterations):
    """Per iteration, the Counter of sample indices all `dp` ranks read from `consumed` on."""
    per_rank = [iter(MegatronPretrainingSampler(TOTAL, consumed, micro, rank, dp))
                for rank in range(dp)]
    micro_batches = global_batch // (micro * dp)
    out = []
    for _ in range(iterations):
        out.append(Counter(i for sampler in per_rank
                           for _ in range(micro_batches) for i in next(sampler)))
    return out


LAYOUTS = [(2, 1), (2, 2), (2, 4), (1, 4), (4, 1)]  # (micro batch, data-parallel size)


@pytest.mark.parametrize("before,after", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_a_resume_at_another_layout_reads_the_uninterrupted_runs_samples(before, after):
    global_batch, saved_at, later = 16, 3, 5
    straight = iterations_consumed(0, *before, global_batch, saved_at + later)
    resumed = iterations_consumed(saved_at * global_batch, *after, global_batch, later)
    assert resumed == straight[saved_at:]


@pytest.mark.parametrize("old,new", [(16, 8), (8, 16), (8, 24), (16, 4)])
def test_a_resume_with_another_global_batch_continues_the_sample_stream(old, new):
    saved_at, later = 3, 4
    straight = iterations_consumed(0, 2, 2, old, TOTAL // old)
    stream = [i for counts in straight for i in sorted(counts.elements())]
    resumed = iterations_consumed(saved_at * old, 2, 2, new, later)
    start = saved_at * old
    for k, counts in enumerate(resumed):  # iteration k after the resume: the next `new` samples
        assert counts == Counter(stream[start + k * new:start + (k + 1) * new])
    before = [i for counts in straight[:saved_at] for i in counts.elements()]
    after = [i for counts in resumed for i in counts.elements()]
    assert sorted(before + after) == list(range(start + later * new))  # no gap, no repeat
