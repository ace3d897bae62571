"""Convert GPT-2 checkpoints between Megatron's layouts (legacy at any TP/PP, torch_dist),
DeepSpeed and Hugging Face.

    python tools/convert_checkpoint.py --load SRC --save DST \
        [--output-format torch|torch_dist|hf] [--input-format torch|torch_dist|deepspeed|hf] \
        [--iteration N] [--target-tensor-model-parallel-size N] \
        [--target-pipeline-model-parallel-size M] [--target-params-dtype fp32|fp16|bf16] \
        [--include-optimizer] [--max-shard-size 2GB] [--vocab-file F --merge-file F] \
        [--metrics-file RUN/metrics.jsonl] [--print-checkpoint-structure]

The input format is detected from the files in SRC (app.checkpoint.formats); --input-format, when
given, must agree with them. The megatron (legacy) and torch_dist outputs are a `release`
checkpoint (weights only; load it with --load or --finetune) unless --iteration is given; with
--include-optimizer it keeps the source's iteration, Adam moments, LR schedule and RNG states,
so --load resumes the run at the new layout (a torch_dist output loads at any layout, so the
target sizes do not apply to it). The output is written to a temporary directory and renamed
to DST at the end. See docs/conversion.md.
"""
import argparse
import logging
import os
import sys
from typing import List, Optional

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _iteration(text: str):
    if text == "release":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--iteration {text!r}: expected a number or 'release'")
    if value < 0:
        raise argparse.ArgumentTypeError(f"--iteration must be >= 0, got {value}")
    return value


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    from app.checkpoint.convert import INPUT_NAMES, OUTPUT_FORMATS, OUTPUT_NAMES
    p.add_argument("--input-format", default=None, choices=INPUT_NAMES,
                   help="the source's format (default: detected from its files; when given, it "
                        "must agree with them). torch (alias megatron): the legacy mp_rank_XX "
                        "files (--ckpt-format torch); torch_dist: Megatron Core's PyTorch "
                        "distributed checkpoint (--ckpt-format torch_dist)")
    p.add_argument("--output-format", choices=OUTPUT_NAMES,
                   default="torch", help=f"one of {', '.join(OUTPUT_FORMATS)} (megatron: "
                   "an alias of torch)")
    p.add_argument("--load", required=True, help="source: checkpoint directory (--save of the run) "
                   "or a Hugging Face save_pretrained directory")
    p.add_argument("--save", help="target directory (must not exist or be empty)")
    p.add_argument("--iteration", type=_iteration, default=None,
                   help="source iteration (default: the latest); for torch output also the "
                        "iteration written (default: release)")
    p.add_argument("--target-tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--target-params-dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="dtype of the written weights (default: the source's)")
    p.add_argument("--include-optimizer", action="store_true",
                   help="also carry the optimizer state, LR schedule and RNG states (torch "
                        "or torch_dist output)")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (hf output)")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json copied into the hf output")
    p.add_argument("--merge-file", help="GPT-2 merges.txt copied into the hf output")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Megatron's vocabulary padding multiple for hf input (default 128)")
    p.add_argument("--metrics-file", default=None,
                   help="hf output: the run's --metrics-file JSONL; the model card (README.md) "
                        "reports its last validation loss")
    p.add_argument("--print-checkpoint-structure", action="store_true",
                   help="print every key, shape and dtype of the source (and convert too if --save)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[convert] %(message)s", stream=sys.stderr)
    a = get_args(argv)
    from app.checkpoint.convert import ConvertOptions, convert, print_structure
    from app.checkpoint.hf_gpt2 import HFConversionError
    from app.checkpoint.layout import LayoutError
    from app.checkpoint.megatron import CheckpointError
    try:
        opts = ConvertOptions(**{k: v for k, v in vars(a).items()})
        if opts.print_checkpoint_structure:
            print("\n".join(print_structure(opts)))
            if not opts.save:
                return 0
        print(convert(opts), file=sys.stderr)
    except (ValueError, CheckpointError, HFConversionError, LayoutError, FileNotFoundError,
            FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
