"""Megatron-LM's entry name: the same trainer as pretrain_gpt2.py, so a Megatron-LM launch script
runs here with only the path to the trainer changed.

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32 ... (Megatron-LM's flags)

Everything (flags, --dry-run, exit codes) is pretrain_gpt2.py's; see README.md and docs/launch.md.
"""
import sys

from pretrain_gpt2 import main

if __name__ == "__main__":
    sys.exit(main())
