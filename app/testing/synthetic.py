"""Synthetic data and in-process run building for tests and benchmarks."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import torch


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


def build_run(argv: Sequence[str], raw_vocab_size: int, num_samples: int) -> Dict[str, Any]:
    """Build config, parallel state, model, engine and Trainer from Megatron flags, in this
    process (torch.distributed already initialised when several ranks run), on RandomTokens.

    Returns dict(cfg, ps, model, engine, trainer, iterator) with the iterator at sample 0.
    """
    import torch.distributed as dist

    import arguments
    from app.data import pad_vocab_size
    from app.training import pretrain
    from app.training.data_loading import build_data_iterator
    from app.training.engine import build_engine
    from app.training.trainer import Trainer

    import os
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():  # launchers export it; DeepSpeed requires it (one machine here)
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    args = arguments.parse_args(list(argv))
    padded = pad_vocab_size(raw_vocab_size, args.make_vocab_size_divisible_by,
                            args.tensor_model_parallel_size)
    cfg = arguments.build_run_config(args, world, raw_vocab_size, padded)
    ps = pretrain.build_parallel_state(cfg, world)
    pretrain.set_seeds(cfg.training.seed, ps)
    model = pretrain.build_model(cfg, ps)
    engine = build_engine(cfg, model, ps, log=lambda *_: None)
    data = RandomTokens(num_samples, cfg.model.seq_length, raw_vocab_size)
    trainer = Trainer(cfg, engine, ps, (data, None, None), eod=0, device=torch.device("cpu"),
                      log=lambda *_: None)
    iterator = build_data_iterator(data, 0, cfg.training.micro_batch_size, ps, 0)
    return dict(cfg=cfg, ps=ps, model=model, engine=engine, trainer=trainer, iterator=iterator)
