"""Data loaders for training and evaluation, and the per-micro-batch batch builder.

Only tensor-parallel rank 0 of each group reads data; it broadcasts the `[b, s+1]` token block
to the other TP ranks, and every rank then builds labels, masks and position ids locally
(deterministic, so they agree). Each data-parallel rank reads its own slice of every global
batch through `MegatronPretrainingSampler`, which starts at `consumed_samples` so a resumed run
continues with exactly the samples an uninterrupted run would have seen next.
"""
from __future__ import annotations

import atexit
import signal
import weakref
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

from app.config import DataConfig, RunConfig
from app.config.batch_schedule import check_batches_from
from app.data import MegatronPretrainingSampler, get_batch
from app.mpu.context_parallel import get_batch_on_this_cp_rank
from app.mpu import collectives
from app.mpu.parallel_state import ParallelState


def _collate(items: Any) -> Dict[str, torch.Tensor]:
    text = np.stack([np.asarray(item["text"], dtype=np.int64) for item in items])
    return {"text": torch.from_numpy(text)}


def _ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM/SIGINT/SIGUSR1 to the trainer: a scheduler that signals
    the whole process group must not kill a worker under the rank's feet before the rank has
    saved its checkpoint (the workers end with the rank)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


def close_data_iterator(iterator: Optional[Iterator]) -> None:
    """Stop the worker processes of an iterator from `build_data_iterator` (nothing to do
    without workers); call it on every exit path. The workers ignore SIGTERM
    (`_ignore_stop_signals`), and the interpreter's exit sends SIGTERM to the live children,
    then waits for them: a worker left running would make the rank wait forever. A worker
    still alive after the DataLoader's own shutdown is killed."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        return
    shutdown()
    for worker in getattr(iterator, "_workers", []):
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5.0)


_LIVE_ITERATORS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _close_live_iterators() -> None:
    """At interpreter exit, before multiprocessing waits for its children: stop the workers
    of the iterators still alive (an exception that leaves the trainer keeps them referenced)."""
    for iterator in list(_LIVE_ITERATORS):
        close_data_iterator(iterator)


def build_data_iterator(dataset: Any, consumed_samples: int, micro_batch_size: int,
                        parallel_state: ParallelState, num_workers: int) -> Optional[Iterator]:
    """An endless-enough iterator of `{"text": [b, s+1]}` micro-batches for this DP rank.

    Returns None on TP ranks other than 0 (they receive batches by broadcast) and when there
    is no dataset. The sampler stops at the end of the dataset, which was sized for the run.
    """
    if dataset is None or parallel_state.tensor_model_parallel_rank != 0:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset), consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=parallel_state.data_parallel_rank,
        data_parallel_size=parallel_state.data_parallel_size)
    # Its own generator: making an iterator draws a worker seed, which must not move the default
    # stream that dropout uses (a resumed run creates its iterators after restoring that stream).
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=_collate,
        persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(0),
        worker_init_fn=_ignore_stop_signals if num_workers > 0 else None)
    iterator = iter(loader)
    if num_workers > 0:
        # registered after multiprocessing's exit hook (the workers imported it): runs first
        atexit.unregister(_close_live_iterators)
        atexit.register(_close_live_iterators)
        _LIVE_ITERATORS.add(iterator)
    return iterator


def check_data_suffices(dataset: Any, split: str, consumed_samples: int, global_batches: int,
                        global_batch_size: int, samples: Optional[int] = None) -> None:
    """Raise ValueError unless `dataset` holds the `global_batches` global batches a run reads
    from sample `consumed_samples` on (nothing to check without a data set or batches); with
    a batch-size schedule `samples` is what those batches hold.

    Called before the loop on every rank, from numbers every rank has, so every rank stops
    alike: running out inside the loop would stop only tensor-parallel rank 0 (the reader) and
    leave the other ranks of its group waiting in the batch broadcast.
    """
    if dataset is None or global_batches <= 0:
        return
    needed = consumed_samples + (global_batches * global_batch_size if samples is None
                                 else samples)
    if needed > len(dataset):
        batches = (f"--global-batch-size {global_batch_size}" if samples is None else
                   "the batch-size schedule")
        raise ValueError(
            f"the {split} data set holds {len(dataset)} samples, but the run reads up to sample "
            f"{needed} ({global_batches} global batches of {batches} from consumed sample "
            f"{consumed_samples}, which a resumed run "
            "takes from its checkpoint, rollback skips included): lower --train-iters, or "
            "build the data sets for this run (they are sized from --train-iters, "
            "--global-batch-size, --eval-interval, --eval-iters and --max-rollbacks)")


def check_run_data(cfg: RunConfig, iteration: int, consumed_train: int, consumed_valid: int,
                   ps: ParallelState, train_ds: Any, valid_ds: Any) -> None:
    """Every rank alike: the training and validation data hold what the iterations left to
    --train-iters read from `iteration` on (evaluations every --eval-interval and one at the
    end), and every batch size the batch-size schedule takes on the way splits into
    micro-batches."""
    t = cfg.training
    left = t.train_iters - iteration
    check_batches_from(cfg.batch_schedule, consumed_train, left, t.micro_batch_size,
                       ps.data_parallel_size,
                       ps.pipeline_model_parallel_size
                       if cfg.virtual_pipeline_model_parallel_size > 1 else 1)
    check_data_suffices(train_ds, "training", consumed_train, left, t.global_batch_size,
                        samples=cfg.batch_schedule.samples_in(left, consumed_train))
    if t.eval_iters:
        check_data_suffices(valid_ds, "validation", consumed_valid,
                            t.evaluations(iteration) * t.eval_iters, t.global_batch_size)


class BatchBuilder:
    """Turns the next micro-batch of an iterator into model inputs on every TP rank."""

    def __init__(self, data_cfg: DataConfig, eod: int, micro_batch_size: int, seq_length: int,
                 parallel_state: ParallelState, device: torch.device) -> None:
        self.cfg = data_cfg
        self.eod = eod
        self.shape = (micro_batch_size, seq_length + 1)
        self.ps = parallel_state
        self.device = device

    def next(self, iterator: Optional[Iterator]) -> Dict[str, Any]:
        """Read (TP rank 0) or receive (other TP ranks) one micro-batch; build its inputs."""
        if self.ps.tensor_model_parallel_rank == 0:
            if iterator is None:
                raise RuntimeError("no data iterator on tensor-parallel rank 0")
            text = next(iterator)["text"].to(self.device)
        else:
            text = torch.empty(self.shape, dtype=torch.int64, device=self.device)
        if self.ps.tensor_model_parallel_size > 1:
            collectives.broadcast(text, self.ps.tensor_model_parallel_src_rank,
                                  self.ps.tensor_model_parallel_group)
        batch = get_batch(text, self.eod, self.cfg.reset_position_ids,
                          self.cfg.attention_mask_resets, self.cfg.eod_mask_loss)
        return get_batch_on_this_cp_rank(batch, self.ps)  # [b, s / C] with context parallelism
