"""Convert a DeepSpeed checkpoint written by pretrain_gpt2.py --deepspeed into Megatron-LM's layout.

    python tools/convert_deepspeed_to_megatron.py --input checkpoints/run --output checkpoints/run_megatron [--tag iter_0000100]

Weights only: for each tensor-parallel rank, `{input}/{tag}/mp_rank_XX_model_states.pt` becomes
`{output}/iter_{n:07d}/mp_rank_XX/model_optim_rng.pt` with Megatron's `model` / `args` /
`iteration` / `checkpoint_version` fields, and the tracker file names the iteration. The
module weights are those DeepSpeed saved (fp32 runs: the exact weights; fp16/bf16 runs: the
half-precision copy; use DeepSpeed's zero_to_fp32.py for the fp32 master weights).
DeepSpeed's own loader unpickles anything (weights_only=False); this tool reads each file the
safe way instead (app.training.deepspeed_engine.load_deepspeed_file: SHA-256 sidecar verified,
weights_only with an allow-list), so a crafted checkpoint is refused, never executed.
"""
import argparse
import glob
import os
import re
import sys


from app.training import checkpoint as ckpt
from app.training.deepspeed_engine import load_deepspeed_file
from app.utils.progress import progress


def _tag(input_dir: str, tag: str = None) -> str:
    if tag:
        return tag
    latest = os.path.join(input_dir, "latest")
    if not os.path.isfile(latest):
        raise SystemExit(f"error: {latest} not found; pass --tag iter_NNNNNNN")
    with open(latest) as f:
        return f.read().strip()


def convert(input_dir: str, output_dir: str, tag: str = None) -> int:
    """Write the Megatron-layout checkpoint; return the iteration converted."""
    tag = _tag(input_dir, tag)
    files = sorted(glob.glob(os.path.join(input_dir, tag, "mp_rank_*_model_states.pt")))
    if not files:
        raise SystemExit(f"error: no mp_rank_*_model_states.pt in {os.path.join(input_dir, tag)}")
    iteration = None
    for path in progress(files, desc="converting"):
        tp_rank = int(re.search(r"mp_rank_(\d+)_model_states", path).group(1))
        try:
            state = load_deepspeed_file(path)
        except ckpt.CheckpointError as exc:
            raise SystemExit(f"error: {exc}") from exc
        iteration = int(state.get("iteration", re.sub(r"\D", "", tag) or 0))
        args = state.get("args")
        if args is None:
            raise SystemExit(f"error: {path} has no 'args' (not written by pretrain_gpt2.py?)")
        weights = {k: v.detach().float().clone() for k, v in state["module"].items()}
        out = ckpt.build_checkpoint_dict(iteration, weights, None, None, None, args)
        ckpt.save_checkpoint(output_dir, iteration, out, tp_rank=tp_rank, pp_rank=0, pp_size=1,
                             is_tracker_writer=False)
    ckpt.write_tracker(output_dir, iteration)
    return iteration


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="DeepSpeed checkpoint directory (the --save dir)")
    p.add_argument("--output", required=True, help="where to write the Megatron-layout checkpoint")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the 'latest' file)")
    a = p.parse_args(argv)
    iteration = convert(a.input, a.output, a.tag)
    print(f"wrote Megatron-layout checkpoint of iteration {iteration} to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
