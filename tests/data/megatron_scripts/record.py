"""Record Megatron-LM's own launch scripts and Megatron's own verdict on them, one fixture per
launch (tests/harness/megatron_scripts.LAUNCHES): `<name>.json` in this directory.

    python tests/data/megatron_scripts/record.py [--tree DIR | --commit REV] [NAME ...]

The tree is `git archive REV examples megatron pretrain_gpt.py` of the Megatron-LM mirror
($MEGATRON_MIRROR; REV default HEAD), or a checkout given with --tree. For each launch:

1. the script runs with bash and a recording torchrun (tests/harness/megatron_scripts.run_launch):
   `torchrun` = the recorded torchrun command line, paths as placeholders; `world_size`,
   `entry`, `argv` = the flags pretrain_gpt.py receives (for the modelopt confs without the
   flags that exist only with NVIDIA Model Optimizer installed: `dropped`);
2. a fresh Python imports Megatron-LM from the tree (tests/harness/megatron_record.py: Triton
   modules stubbed, one H100 stood in for torch.cuda) and runs what pretrain_gpt.py runs before
   building anything: `parse_args()` and `validate_args(args, {"tokenizer_type":
   "GPT2BPETokenizer"})` with WORLD_SIZE = the launch's world, RANK 0 and the launch's
   environment. `verdict` accept | refuse, `stage` parse_args | validate_args, `message` (the
   argparse error line, or "Type: text" of the exception) and `source` (file:line raising);
   `stdout_head`: the first lines validate_args printed ("using world size: ...");
3. on accept, `flops_per_iteration` = Megatron's `num_floating_point_operations(args,
   global_batch_size)` (megatron/training/training.py) on a copy of args, with
   `padded_vocab_size` from Megatron's own padding of `raw_vocab_size`: --vocab-size for
   NullTokenizer (main's NullTokenizer has exactly that many ids), else REFERENCE_VOCAB
   (a stand-in: the script's tokenizer files are not here), or --padded-vocab-size when given;
   `args` = the validated namespace (tests/harness/megatron_record.encode's tags).
"""
import argparse
import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)  # run as a script: the shared recorder code is in tests/harness

from tests.harness import megatron_scripts as scripts  # noqa: E402
from tests.harness.megatron_record import MIRROR, encode, fake_h100, import_megatron_from  # noqa: E402

REFERENCE_VOCAB = 32000
"""Raw vocabulary assumed for the FLOPs of a launch whose tokenizer is a file."""


def _modelopt_only_flags():
    """Option strings add_modelopt_args defines that Megatron's own parser does not."""
    from megatron.post_training.arguments import add_modelopt_args
    from megatron.training.arguments import add_megatron_arguments
    base = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    extra = add_modelopt_args(argparse.ArgumentParser(allow_abbrev=False))
    return {s: a.nargs for s, a in extra._option_string_actions.items()  # noqa: SLF001
            if s.startswith("--") and s not in base._option_string_actions}  # noqa: SLF001


def _drop(flags, only):
    """(flags without the options in `only` {spelling: nargs} and their values, dropped)."""
    kept, dropped, i = [], [], 0
    while i < len(flags):
        name = flags[i].split("=", 1)[0]
        if name in only:
            n = 0 if ("=" in flags[i] or only[name] == 0) else 1
            dropped.extend(flags[i:i + 1 + n])
            i += 1 + n
        else:
            kept.append(flags[i])
            i += 1
    return kept, dropped


def _raw_vocab(args):
    if args.tokenizer_type == "NullTokenizer":
        return args.vocab_size, "--vocab-size (main's NullTokenizer: exactly that many ids)"
    return REFERENCE_VOCAB, (f"{REFERENCE_VOCAB}: a stand-in for the {args.tokenizer_type} files "
                             "the script names (not available here)")


def child(tree, request_path, out_path):
    """In a fresh process: Megatron's verdict on the request's flags (module docstring)."""
    with open(request_path) as f:
        request = json.load(f)
    os.environ.update(request["env"])
    os.environ.update(WORLD_SIZE=str(request["world_size"]), RANK="0", LOCAL_RANK="0")
    import_megatron_from(tree)
    fake_h100()
    result = {}
    flags = request["flags"]
    if request["modelopt"]:
        flags, result["dropped"] = _drop(flags, _modelopt_only_flags())
    result["argv"] = flags
    sys.argv = ["pretrain_gpt.py", *flags]
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            from megatron.training.arguments import parse_args, validate_args
            args = parse_args()
            validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        result.update(verdict="accept", stage=None, message=None, source=None)
    except SystemExit:
        result.update(verdict="refuse", stage="parse_args",
                      message=err.getvalue().strip().splitlines()[-1], source=None)
        args = None
    except Exception as exc:  # noqa: BLE001 (any refusal of validate_args is the verdict)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        result.update(verdict="refuse", stage="validate_args",
                      message=f"{type(exc).__name__}: {exc}",
                      source=f"{os.path.relpath(frame.filename, tree)}:{frame.lineno}")
        args = None
    result["stdout_head"] = [line for line in out.getvalue().splitlines() if line.strip()][:4]
    if args is not None:
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
        from megatron.training.training import num_floating_point_operations
        raw, why = _raw_vocab(args)
        padded = args.padded_vocab_size or vocab_size_with_padding(raw, args, False)
        result.update(raw_vocab_size=raw, raw_vocab_size_by=why, padded_vocab_size=padded)
        counted = copy.deepcopy(args)  # the function writes num_query_groups
        counted.padded_vocab_size = padded
        result["flops_per_iteration"] = num_floating_point_operations(
            counted, args.global_batch_size)
        result["args"] = {k: encode(v) for k, v in sorted(vars(args).items())}
    with open(out_path, "w") as f:
        json.dump(result, f)


def record(tree, commit, names):
    """Write `<name>.json` for each launch in `names` from Megatron-LM `tree`."""
    for name in names:
        launch = scripts.LAUNCHES[name]
        with tempfile.TemporaryDirectory() as base:
            ran = scripts.run_launch(tree, launch, base)
            world, entry, flags = scripts.split_torchrun(ran["torchrun"])
            request, out = os.path.join(base, "request.json"), os.path.join(base, "out.json")
            where = scripts.paths(base)
            with open(request, "w") as f:
                json.dump({"env": {k: scripts.fill(v, where) for k, v in ran["env"].items()},
                           "world_size": world, "flags": [scripts.fill(a, where) for a in flags],
                           "modelopt": launch.conf is not None}, f)
            proc = subprocess.run([sys.executable, __file__, "--child", tree, request, out],
                                  cwd=base, capture_output=True, text=True,
                                  env=dict(os.environ, HF_HUB_OFFLINE="1",
                                           TRANSFORMERS_OFFLINE="1"))
            if proc.returncode:
                raise RuntimeError(f"{name}: the verdict child failed:\n{proc.stderr[-3000:]}")
            with open(out) as f:
                verdict = json.loads(scripts.unfill(f.read(), where))
        data = {"megatron": "main", "commit": commit, "script": launch.script,
                "conf": launch.conf, "script_args": list(launch.args),
                "script_env": dict(launch.env), "torchrun": ran["torchrun"],
                "world_size": world, "entry": os.path.basename(entry), "env": ran["env"],
                **verdict}
        with open(os.path.join(HERE, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=0)
            f.write("\n")
        print(f"{name}: world {world}, Megatron {data['verdict']}"
              + (f" ({data['stage']}: {data['message'][:100]})" if data["stage"] else ""))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", help="a Megatron-LM checkout (default: archive --commit)")
    parser.add_argument("--commit", default="HEAD", help="revision of $MEGATRON_MIRROR")
    parser.add_argument("names", nargs="*", help="launches to record (default: all)")
    a = parser.parse_args(argv)
    names = a.names or list(scripts.LAUNCHES)
    if a.tree:
        commit = subprocess.run(["git", "-C", a.tree, "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
        record(os.path.abspath(a.tree), commit, names)
        return
    commit = subprocess.check_output(["git", "-C", MIRROR, "rev-parse", f"{a.commit}^{{commit}}"],
                                     text=True).strip()
    with tempfile.TemporaryDirectory() as tree:
        scripts.copy_tree_parts(MIRROR, commit, tree)
        record(tree, commit, names)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
    else:
        main(sys.argv[1:])
