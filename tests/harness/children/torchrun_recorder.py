"""Stands in for `torchrun` when a Megatron-LM launch script runs under test: writes the
arguments it was given, its working directory and the launch environment (CUDA_*, NCCL_*,
NVTE_*, MASTER_*, OMP_*, TOKENIZERS_*, HF_*) as JSON to $TORCHRUN_RECORD, and runs nothing.

    TORCHRUN_RECORD=out.json torchrun_recorder.py --nproc_per_node 8 ... pretrain_gpt.py FLAGS
(tests/harness/megatron_scripts.py puts a `torchrun` that execs this first on PATH.)
"""
import json
import os
import sys

PREFIXES = ("CUDA_", "NCCL_", "NVTE_", "MASTER_", "OMP_", "TOKENIZERS_", "HF_")

if __name__ == "__main__":
    with open(os.environ["TORCHRUN_RECORD"], "w", encoding="utf-8") as f:
        json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(),
                   "env": {k: v for k, v in sorted(os.environ.items())
                           if k.startswith(PREFIXES)}}, f, indent=1)
