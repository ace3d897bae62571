"""Pretrain GPT-2 with Megatron-LM's flags, on the native path or through DeepSpeed.

    python pretrain_gpt2.py --num-layers 4 --hidden-size 256 ... --data-path data/corpus_content_document
    torchrun --nproc-per-node 2 pretrain_gpt2.py --tensor-model-parallel-size 2 ...
    deepspeed pretrain_gpt2.py --deepspeed --deepspeed_config ds_configs/zero2.json ...

The composition root: flags -> RunConfig (once, arguments.py) -> app.training.pretrain.pretrain.
See README.md and docs/ for every flag.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional

import arguments
from app.data import build_tokenizer
from app.training import pretrain as pretrain_lib
from app.training.distributed import discover_world


def run(argv: Optional[List[str]] = None) -> Any:
    """Parse `argv`, build the RunConfig and train; returns the Trainer."""
    args = arguments.parse_args(argv)
    world = discover_world(args.deepspeed_mpi)
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    cfg = arguments.build_run_config(args, world.world_size, tokenizer.vocab_size)
    return pretrain_lib.pretrain(cfg, tokenizer, arguments.format_args(args))


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry: exit code 0, or 2 with one clear line for bad flags, data or
    checkpoints."""
    return pretrain_lib.main(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
