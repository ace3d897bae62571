"""Record the `args` Namespace that Megatron-LM's own parse_args + validate_args (+ its tokenizer
build, which sets padded_vocab_size) make for a few GPT flag sets, at a Megatron-LM version.

    python tests/data/megatron_args/record.py core_v0.16.1 [HEAD ...] [--only FLAG_SET ...]

For each version: `git archive <version> megatron` of the Megatron-LM mirror
($MEGATRON_MIRROR, default /work/.mirror/NVIDIA+Megatron-LM/repo) is extracted into a temporary
directory and imported from there (ahead of the installed megatron-core), and for every flag set
of FLAG_SETS a fresh Python runs `megatron.training.arguments.parse_args` (sys.argv is the flag
set), `validate_args(args, {})` and `megatron.training.global_vars._build_tokenizer(args)`
(GPT2BPETokenizer from tests/data/old_checkpoints/data's vocab.json and merges.txt; today's
main builds it through the Hugging Face hub, offline here, so there padded_vocab_size comes from
Megatron's own vocab_size_with_padding of the vocab.json size, as `padded_vocab_size_by` says). The
namespace is written as `<version>/<flag set>.json` (`encode`'s type tags; `fixtures.load` reads
them back).

Only the environment is stood in for, never Megatron's arithmetic (tests/harness/megatron_record.py:
Triton modules stubbed, `typing.override` on Python 3.11).
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)  # run as a script: the shared recorder code is in tests/harness

from tests.harness.megatron_record import MIRROR, encode, import_megatron_from  # noqa: E402
TOKENIZER = os.path.join(ROOT, "tests", "data", "old_checkpoints", "data")

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-2",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--make-vocab-size-divisible-by", "8",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{TOKENIZER}/vocab.json",
        "--merge-file", f"{TOKENIZER}/merges.txt", "--ckpt-format", "torch_dist",
        "--seed", "1234"]
FLAG_SETS = {
    "gpt2": [],
    "gpt2_legacy": ["--ckpt-format", "torch"],
    "gqa": ["--group-query-attention", "--num-query-groups", "2"],
    "rope_untied": ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"],
    "swiglu_rmsnorm": ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"],
    "qwen3_moe": ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                  "--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2",
                  "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2"],
    "moe_options": ["--swiglu", "--disable-bias-linear", "--num-experts", "4",
                    "--moe-layer-freq", "([0]+[1]*1)", "--moe-router-topk", "3",
                    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                    "--moe-router-bias-update-rate", "1e-2", "--moe-z-loss-coeff", "1e-3",
                    "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall",
                    "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
                    "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
                    "--moe-token-drop-policy", "position", "--moe-router-topk-scaling-factor",
                    "2.0", "--moe-per-layer-logging", "--moe-router-load-balancing-type",
                    "seq_aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "1e-2", "1e-3"],
}
"""Flag sets (after BASE): the run each fixture describes."""


def child(tree, flag_set, out):
    """In a fresh process: parse, validate and build the tokenizer; write the namespace."""
    import_megatron_from(tree)
    sys.argv = ["pretrain_gpt.py", *BASE, *FLAG_SETS[flag_set]]
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    args = parse_args()
    validate_args(args, {})
    padding = "the tokenizer build"
    try:
        global_vars._build_tokenizer(args)
    except (OSError, ValueError) as exc:  # main builds GPT2BPETokenizer via the Hugging Face hub
        if "huggingface.co" not in str(exc):
            raise
        builder = sys.modules[global_vars.build_tokenizer.__module__]
        pad = getattr(builder, "vocab_size_with_padding", None) or builder._vocab_size_with_padding
        with open(args.vocab_file) as f:
            args.padded_vocab_size = pad(len(json.load(f)), args)
        padding = (f"{pad.__module__}.{pad.__name__}(len(vocab.json)): the tokenizer build "
                   f"needs the network ({type(exc).__name__})")
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "padded_vocab_size_by": padding,
                   "args": {k: encode(v) for k, v in
                                                   sorted(vars(args).items())}}, f, indent=0)
        f.write("\n")


def record(version, only=None):
    """Write `<version>/<flag set>.json` for every flag set (or those in `only`), from the
    mirror's `version`."""
    commit = subprocess.check_output(["git", "-C", MIRROR, "rev-parse", f"{version}^{{commit}}"],
                                     text=True).strip()
    target = os.path.join(HERE, version)
    os.makedirs(target, exist_ok=True)
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.Popen(["git", "-C", MIRROR, "archive", commit, "megatron"],
                                   stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tree], stdin=archive.stdout, check=True)
        archive.wait()
        for flag_set in only or FLAG_SETS:
            out = os.path.join(target, f"{flag_set}.json")
            subprocess.run([sys.executable, __file__, "--child", tree, flag_set, out], check=True,
                           cwd=tree, stdout=subprocess.DEVNULL,
                           env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
            with open(out) as f:
                data = json.load(f)
            data = {"megatron": version, "commit": commit, **data}
            data["argv"] = [a.replace(ROOT + os.sep, "") for a in data["argv"]]
            for key in ("vocab_file", "merge_file"):  # the repository's files, not this machine's
                data["args"][key] = data["args"][key].replace(ROOT + os.sep, "")
            with open(out, "w") as f:
                json.dump(data, f, indent=0, sort_keys=False)
                f.write("\n")
            print(f"{out}: {len(data['args'])} args")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:  # record.py VERSION... [--only FLAG_SET...]
        names = sys.argv[1:]
        only = names[names.index("--only") + 1:] if "--only" in names else None
        for name in names[:names.index("--only")] if only else names:
            record(name, only)
