"""Convert GPT-2 and Llama-style checkpoints between Megatron's layouts (legacy at any TP/PP,
torch_dist), DeepSpeed and Hugging Face (GPT-2, Llama, Qwen3).

    python tools/convert_checkpoint.py --load SRC --save DST \
        [--output-format torch|torch_dist|hf] [--input-format torch|torch_dist|deepspeed|hf] \
        [--iteration N] [--target-tensor-model-parallel-size N] \
        [--target-pipeline-model-parallel-size M] [--target-params-dtype fp32|fp16|bf16] \
        [--include-optimizer] [--max-shard-size 2GB] [--vocab-file F --merge-file F | \
        --tokenizer-model DIR|FILE.model] \
        [--metrics-file RUN/metrics.jsonl] [--print-checkpoint-structure]

The input format is detected from the files in SRC (app.checkpoint.formats); --input-format, when
given, must agree with them. The megatron (legacy) and torch_dist outputs are a `release`
checkpoint (weights only; load it with --load or --finetune) unless --iteration is given; with
--include-optimizer it keeps the source's iteration, Adam moments, LR schedule and RNG states,
so --load resumes the run at the new layout (a torch_dist output loads at any layout, so the
target sizes do not apply to it). The output is written to a temporary directory and renamed
to DST at the end. See docs/conversion.md.
"""
import logging
import os
import sys
from typing import List, Optional

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.checkpoint.convert import ConvertOptions  # noqa: E402
from app.config.cli import parse_config  # noqa: E402


def get_options(argv: Optional[List[str]] = None) -> ConvertOptions:
    """The command line as ConvertOptions; a bad flag is a usage error (exit status 2)."""
    return parse_config(ConvertOptions, argv, " ".join(__doc__.split("\n\n")[0].split()))


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[convert] %(message)s", stream=sys.stderr)
    from app.checkpoint.convert import convert, print_structure
    from app.checkpoint.hf.files import HFConversionError
    from app.checkpoint.param_layout import LayoutError
    from app.checkpoint import CheckpointError
    try:
        opts = get_options(argv)  # a --load that holds no checkpoint: CheckpointError, below
        if opts.print_checkpoint_structure:
            print("\n".join(print_structure(opts)))
            if not opts.save:
                return 0
        print(convert(opts), file=sys.stderr)
    except SystemExit as stop:  # a usage error (reported) or --help: main returns the status
        return stop.code
    except (ValueError, CheckpointError, HFConversionError, LayoutError, FileNotFoundError,
            FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
