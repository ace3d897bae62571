"""Pretrain GPT-2 with Megatron-LM's flags, on the native path or through DeepSpeed.

    python pretrain_gpt2.py --num-layers 4 --hidden-size 256 ... --data-path data/corpus_content_document
    torchrun --nproc-per-node 2 pretrain_gpt2.py --tensor-model-parallel-size 2 ...
    deepspeed pretrain_gpt2.py --deepspeed --deepspeed_config ds_configs/zero2_fp32.json ...

See README.md and docs/ for every flag; the work happens in app.training.pretrain.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from app.training.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
