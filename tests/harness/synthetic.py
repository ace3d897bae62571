"""Synthetic data and in-process run building for tests and benchmarks."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from app.config import RunConfig


class RandomTokens:
    """`n` samples of `seq + 1` uniformly random token ids (fixed seed), as GPT datasets give
    them (`{"text": int64 [seq + 1]}`): for step timing and engine tests, where the data's
    content does not matter but every layout must read the same samples."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        self.data = np.random.default_rng(seed).integers(0, vocab, (n, seq + 1), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        return {"text": self.data[i]}


def build_synthetic_run(cfg: RunConfig, num_samples: int,
                        device: Optional[torch.device] = None, loss_function: Any = None,
                        return_logits: bool = False) -> Dict[str, Any]:
    """The run of `cfg` built by app.training.run.build_run in this process (torch.distributed
    already initialised when several ranks run), on `device` (default CPU), over RandomTokens;
    the Trainer gets `loss_function` and `return_logits` (see app.training.trainer.Trainer).

    Returns dict(cfg, ps, model, engine, trainer, iterator) with the iterator at sample 0.
    """
    import torch.distributed as dist

    from app.training.data_loading import build_data_iterator
    from app.training.run import build_run

    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():  # launchers export it; DeepSpeed requires it (one machine here)
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    run = build_run(cfg, world, torch.device("cpu") if device is None else torch.device(device))
    data = RandomTokens(num_samples, cfg.model.seq_length, cfg.raw_vocab_size)
    trainer = run.attach_trainer((data, None, None), eod=0, loss_function=loss_function,
                                 return_logits=return_logits)
    iterator = build_data_iterator(data, 0, cfg.training.micro_batch_size, run.ps, 0)
    return dict(cfg=cfg, ps=run.ps, model=run.model, engine=run.engine, trainer=trainer,
                iterator=iterator)


def train_steps(run: Dict[str, Any], iterations: int,
                iterator: Any = None) -> List[Tuple[float, float]]:
    """(loss, grad norm) of `iterations` train steps of a build_synthetic_run run, on its own
    iterator unless `iterator` is given."""
    iterator = run["iterator"] if iterator is None else iterator
    return [(s.loss, s.grad_norm) for s in
            (run["trainer"].train_step(iterator) for _ in range(iterations))]
