"""Recording the training samples each rank reads: with MegatronPretrainingSampler.__iter__
replaced by recording_iter(path) (in the test process, or on each rank of
tests.harness.distributed.run_pretrain through its `setup`), every index list the sampler yields
is appended as one JSON line to `path`.

With --num-workers 0 the data loader asks its sampler for the next index list only when the
trainer asks for the next micro-batch, and with --eval-iters 0 only the training data is read,
so the lines are the micro-batches the training consumed, in order.
"""
import json
from collections import Counter
from typing import Dict, List

from app.data import MegatronPretrainingSampler


def recording_iter(path: str):
    """A MegatronPretrainingSampler.__iter__ that appends each index list it yields to `path`."""
    original = MegatronPretrainingSampler.__iter__

    def __iter__(self):
        for indices in original(self):
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(indices) + "\n")
            yield indices

    return __iter__


def iterations_read(paths: List[str], micro_batches: int, first_iteration: int
                    ) -> Dict[int, Counter]:
    """{iteration: Counter of the sample indices all the ranks' logs in `paths` read in it},
    each rank reading `micro_batches` micro-batches per iteration from `first_iteration` on."""
    per_rank = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            per_rank.append([json.loads(line) for line in f if line.strip()])
    counts = {len(lines) for lines in per_rank}
    assert len(counts) == 1 and counts.pop() % micro_batches == 0, f"uneven logs: {paths}"
    out: Dict[int, Counter] = {}
    for k in range(len(per_rank[0]) // micro_batches):
        out[first_iteration + k] = Counter(
            i for lines in per_rank for batch in lines[k * micro_batches:(k + 1) * micro_batches]
            for i in batch)
    return out
