"""Megatron-LM's own launch scripts run here unchanged (tests/data/megatron_scripts: each
script's launch as torchrun received it, and Megatron-LM's own verdict and FLOP count on it,
recorded with Megatron's code by record.py there).

For every recorded launch, with a device large enough (the flags' verdict; whether the model
fits is the dry run's own extra judgement):
- our `pretrain_gpt.py ARGV --dry-run` at the launch's world size accepts exactly when
  Megatron's parse_args + validate_args accepted, and a refusal names what Megatron's names;
- our FLOP count of the launch's model equals Megatron's num_floating_point_operations;
- where both accept, the launch's flags with a shrunk model appended (later flags win, as in
  Megatron; FP8 removed, as this machine has no FP8 GPU) train 6 iterations at 2 ranks under
  torchrun (one spawn for all: tests/harness/children/megatron_shrunk.py) on a small dataset
  made with the launch's own tokenizer type: exit 0, loss finite and falling, and the log and
  TensorBoard hold what the flags ask for (Megatron's layout line, throughput field and tags,
  the profiler trace of the profiled iterations);
- the launch with FP8 on this machine stops at once, naming the FP8 flags.

Flags other work adds (WAITING) make our verdict differ until that work is merged: for those
launches the refusal must name only such flags, and the launch without them is held to all of
the above. A WAITING entry whose flag is accepted here is reported, so the table shrinks as the
flags land. With MEGATRON_LM naming a Megatron-LM checkout, each script is also run with bash
and a recording torchrun, and must still give the recorded command line.
"""
import contextlib
import gzip
import io
import json
import math
import os
import re
import sys

import pytest

from tests.harness import megatron_scripts as scripts
from tests.harness.corpus import read_metrics, stdlib_texts
from tests.harness.launch import ROOT, run

NAMES = scripts.names()
WAITING = {}  # flag: (whose work adds it, how many values it takes)
WAITING_VALUES = {}
"""A flag value other work adds -> the value with the same meaning here until then."""
EQUIVALENT = {}
"""A WAITING flag -> the flags with the same meaning here until then."""
SHRINK = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
          "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
          "--seq-length", "64", "--max-position-embeddings", "64", "--global-batch-size", "4",
          "--lr", "1e-3", "--min-lr", "1e-4", "--eval-iters", "1", "--log-interval", "1"]
LENGTH = {"samples": ["--train-samples", "24", "--lr-decay-samples", "24",
                      "--lr-warmup-samples", "4"],
          "iterations": ["--train-iters", "6", "--lr-decay-iters", "6", "--lr-warmup-iters", "1"]}
"""6 iterations of 4 samples, in the launch's own unit (Megatron refuses mixing them)."""
"""Appended to a launch (later flags win): 2 layers of width 64, 6 iterations of 4 samples of 64
tokens, an LR that moves a tiny model in 6 steps (the scripts' LR schedules are for 10^5+
iterations); a vocabulary to match (--vocab-size 512 for NullTokenizer, --padded-vocab-size 384
where the launch gives Qwen's 151936: rows for the 320-token test tokenizer)."""
MOE_SHRINK = ["--num-experts", "8", "--moe-ffn-hidden-size", "64",
              "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "2"]
"""Appended to an MoE launch: 8 experts of width 64, expert-parallel over the 2 ranks (the
scripts' 4 pipeline stages and 8 expert ranks need 32 GPUs)."""
FP8_FLAGS = {"--fp8-format": 1, "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": 1,
             "--fp8-param-gather": 0, "--fp8-recipe": 1, "--fp8-margin": 1}


def _drop(argv, flags):
    """`argv` without the options in `flags` {flag: values it takes}."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += 1 + flags[argv[i]]
        else:
            out.append(argv[i])
            i += 1
    return out


def waiting_of(argv):
    """{flag or flag=value: whose work} of `argv` that this tree does not have yet."""
    found = {flag: WAITING[flag][0] for flag in argv if flag in WAITING}
    for (flag, value), (owner, _) in WAITING_VALUES.items():
        if any(a == flag and b == value for a, b in zip(argv, argv[1:])):
            found[f"{flag} {value}"] = owner
    return found


def _moe_waiting(argv):
    """An MoE model (--num-experts) while the MoE flags are not here yet."""
    return "--num-experts" in argv and "--num-experts" in WAITING


def without_waiting(argv):
    """`argv` without the WAITING flags (EQUIVALENT ones replaced by today's spelling),
    WAITING_VALUES replaced by today's equivalents."""
    argv = [x for a in argv for x in (EQUIVALENT.get(a, [a]) if a in WAITING else [a])]
    argv = _drop(argv, {flag: nargs for flag, (_, nargs) in WAITING.items()})
    for (flag, value), (_, today) in WAITING_VALUES.items():
        argv = [today if a == value and i and argv[i - 1] == flag else a
                for i, a in enumerate(argv)]
    return argv


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """{tokenizer type: placeholder paths} with the tokenizer files and a small dataset made
    with that tokenizer type, built once per type."""
    base = tmp_path_factory.mktemp("megatron_scripts")
    texts = [t[:6000] for t in stdlib_texts(12)]
    made = {}
    for name in NAMES:
        argv = without_waiting(scripts.fixture(name)["argv"])
        kind = argv[argv.index("--tokenizer-type") + 1] if "--tokenizer-type" in argv \
            else "GPT2BPETokenizer"
        if kind not in made:
            made[kind] = scripts.paths(str(base / kind))
            if name != "gpt3_175b":  # refused while parsing: its files are never read
                scripts.make_assets(kind, made[kind], texts)
    return base, made


def launch_argv(name, assets_, run_dir):
    """The launch's flags with its placeholders filled: tokenizer and data from `assets_`,
    checkpoints, TensorBoard and the working directory under `run_dir`."""
    record = scripts.fixture(name)
    base, made = assets_
    argv = record["argv"]
    kind = next((b for a, b in zip(argv, argv[1:]) if a == "--tokenizer-type"),
                "GPT2BPETokenizer")
    shared = made.get(WAITING_VALUES.get(("--tokenizer-type", kind), (None, kind))[1],
                      made.get(kind, {}))
    where = {**scripts.paths(str(run_dir)), **{k: v for k, v in shared.items()
                                             if k not in ("{ckpt}", "{tb}", "{cwd}")}}
    return [scripts.fill(a, where) for a in argv]


def our_verdict(argv, world):
    """("accept" | "refuse", what we said): our --dry-run of `argv` for `world` ranks with a
    device large enough, in this process."""
    import pretrain_gpt
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = pretrain_gpt.main([*argv, "--dry-run", "--dry-run-world-size", str(world),
                                      "--dry-run-device-memory", "1000000"])
    except SystemExit as exc:  # argparse
        code = exc.code
    said = "\n".join(line for line in (out.getvalue() + err.getvalue()).splitlines()
                     if "ERROR" in line or "error:" in line)
    return ("accept" if code == 0 else "refuse"), said


def _check_flops(name, argv, world):
    import arguments
    from app.training.telemetry.flops import num_floating_point_operations
    record = scripts.fixture(name)
    cfg = arguments.build_run_config(arguments.parse_args(argv), world,
                                     record["raw_vocab_size"])
    assert cfg.model.padded_vocab_size == record["padded_vocab_size"], name
    ours = num_floating_point_operations(cfg.model, cfg.training.global_batch_size)
    assert ours == pytest.approx(record["flops_per_iteration"], rel=1e-12), name
    if world == record["world_size"]:
        assert cfg.parallel.megatron_layout() == record["stdout_head"][0], name


@pytest.mark.parametrize("name", NAMES)
def test_our_verdict_is_megatrons(name, assets, tmp_path):
    """The flags' verdict equals Megatron's; refusals name what Megatron named; accepted
    launches count Megatron's FLOPs and print Megatron's layout line."""
    record = scripts.fixture(name)
    argv, world = launch_argv(name, assets, tmp_path), record["world_size"]
    verdict, said = our_verdict(argv, world)
    waiting = waiting_of(record["argv"])
    if record["verdict"] == "refuse":
        assert verdict == "refuse", f"{name}: Megatron refused ({record['message']}), we accept"
        unrecognized = record["message"].split("unrecognized arguments:")[-1].split()
        assert all(word in said for word in unrecognized), (record["message"], said)
        return
    if waiting:
        assert verdict == "refuse", (f"{name} is accepted here now: drop {sorted(waiting)} from "
                                     "WAITING in this test")
        named = said.split("unrecognized arguments:")[-1] if "unrecognized" in said else said
        assert any(flag.split()[-1] in named for flag in waiting), (waiting, said)
        if "unrecognized" in said:  # every flag we do not know is one other work adds
            unknown = {w for w in named.split() if w.startswith("--")}
            assert unknown <= set(WAITING), unknown - set(WAITING)
        argv = without_waiting(argv)
        verdict, said = our_verdict(argv, world)
    layout = re.search(r"expert_tensor_model_pipeline_parallel size \((\d+)", said)
    if verdict == "refuse" and layout and said.count("ERROR") == 1:
        # Megatron's validate_args does not check the expert layout against the world; its
        # start does (initialize_model_parallel, in the words we use): our dry run's own layout
        # finding. The flags' verdict is the one at the smallest world the layout allows.
        world = int(layout.group(1))
        verdict, said = our_verdict(argv, world)
    assert verdict == "accept", f"{name}: Megatron accepts, we refuse:\n{said}"
    if not {"--num-experts", "--padded-vocab-size"} & set(waiting):  # (they change the count)
        _check_flops(name, argv, world)


def shrunk_runs(assets_, base):
    """(runs for the spawn, {name: (argv, metrics file)}) of every launch both accept."""
    from app.launch.ports import free_port
    runs, info = [], {}
    for name in NAMES:
        record = scripts.fixture(name)
        if record["verdict"] != "accept" or _moe_waiting(record["argv"]):
            continue
        run_dir = base / name
        argv = _drop(without_waiting(launch_argv(name, assets_, run_dir)), FP8_FLAGS)
        metrics = str(run_dir / "metrics.jsonl")
        tail = SHRINK + LENGTH["samples" if "--train-samples" in argv else "iterations"] + [
            "--metrics-file", metrics] + (
            ["--vocab-size", "512"] if "NullTokenizer" in argv else []) + (
            ["--padded-vocab-size", "384"] if "--padded-vocab-size" in argv else []) + (
            MOE_SHRINK if "--num-experts" in argv else [])
        runs.append({"name": name, "argv": argv + tail, "port": free_port(),
                     "log": str(run_dir / "log")})
        info[name] = (argv + tail, metrics)
        os.makedirs(run_dir, exist_ok=True)
    return runs, info


def _log(run_dir, rank=1):
    with open(os.path.join(run_dir, f"log.rank{rank}"), errors="replace") as f:
        return f.read()


def _check_profile(run_dir, argv):
    """The torch.profiler trace of Megatron's window (iterations start .. end - 1)."""
    start = int(argv[argv.index("--profile-step-start") + 1])
    end = int(argv[argv.index("--profile-step-end") + 1])
    tb = argv[len(argv) - 1 - argv[::-1].index("--tensorboard-dir") + 1]
    trace = os.path.join(os.path.dirname(tb), "torch_profile", "rank-0.json.gz")
    with gzip.open(trace, "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    profiled = {n for n in names if n and n.startswith("iteration ")}
    assert profiled == {f"iteration {i}" for i in range(start, end)}, profiled


def _check_tensorboard(argv, validated):
    """Megatron's tags, every iteration; the validation loss's when the run validated."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = argv[len(argv) - 1 - argv[::-1].index("--tensorboard-dir") + 1]
    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "batch-size",
            "tokens-per-second", "mfu"} <= tags, tags
    assert validated == ("lm loss validation" in tags), tags
    if "--num-experts" in argv:  # MoE's losses under Megatron's names, without twins as there
        assert "load_balancing_loss" in tags and "load_balancing_loss vs samples" not in tags
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, 7))


def test_shrunk_launches_train_under_torchrun(assets, tmp_path):
    """Every launch both accept trains 6 iterations at 2 ranks in one torchrun spawn."""
    runs, info = shrunk_runs(assets, tmp_path)
    if not runs:
        pytest.skip("no launch is accepted by both yet")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"runs": runs, "timeout": 240}))
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         os.path.join(ROOT, "tests", "harness", "children", "megatron_shrunk.py"), str(spec)],
        tmp_path, timeout=240 * len(runs))
    codes = [json.loads((tmp_path / f"exit_codes.rank{r}.json").read_text()) for r in (0, 1)]
    for name, (argv, metrics) in info.items():
        run_dir = tmp_path / name
        assert codes[0][name] == codes[1][name] == 0, (name, _log(run_dir)[-3000:])
        losses = [r["lm_loss"] for r in read_metrics(metrics) if r["kind"] == "train"]
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses), (name, losses)
        assert losses[-1] < losses[0], (name, losses)
        log = _log(run_dir, 0)
        assert ("using world size: 2, data-parallel size: 2, context-parallel size: 1, "
                "hierarchical context-parallel sizes: None, tensor-model-parallel size: 1, "
                "pipeline-model-parallel size: 1") in log, name
        if "--log-throughput" in argv:
            assert "throughput per GPU (TFLOP/s/GPU):" in _log(run_dir, 1), name
        if "--profile" in argv:
            _check_profile(run_dir, argv)
        if "--tensorboard-dir" in argv:
            _check_tensorboard(argv, " valid loss at iteration 6 " in _log(run_dir, 1))


def test_fp8_launch_stops_at_once_on_this_machine(assets, tmp_path):
    """A real start of the FP8 launch here (no FP8 GPU) exits 2 before any process group, with
    one line naming the FP8 flags and what they need."""
    from tests.harness.launch import main_in_process
    name = next(n for n in NAMES if "--fp8-format" in scripts.fixture(n)["argv"])
    argv = (without_waiting(launch_argv(name, assets, tmp_path)) + SHRINK + LENGTH["samples"]
            + ["--vocab-size", "512"])
    code, err = main_in_process(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--fp8-format hybrid" in lines[0] and "Transformer Engine" in lines[0], lines[0]


VENDORED = os.path.join(ROOT, "tests", "data", "megatron_scripts", "megatron_lm")
"""Megatron-LM's own launch scripts and the files they source, unmodified, at the commit the
fixtures were recorded at (its README says which; BSD-3-Clause, its LICENSE beside them)."""


@pytest.mark.parametrize("name", NAMES)
def test_the_scripts_still_launch_what_was_recorded(name, tmp_path):
    """Each of Megatron-LM's scripts, run as written with bash and a recording torchrun, gives
    the recorded command line that the other tests train with: the vendored copies in every
    run, a Megatron-LM checkout instead when MEGATRON_LM names one."""
    record = scripts.fixture(name)
    tree = os.environ.get("MEGATRON_LM") or VENDORED
    ran = scripts.run_launch(tree, scripts.LAUNCHES[name], str(tmp_path))
    assert ran["torchrun"] == record["torchrun"]


def test_status_table_lists_every_launch_with_megatrons_verdict():
    """docs/status.md's table has a row per recorded launch with Megatron's verdict."""
    with open(os.path.join(ROOT, "docs", "status.md")) as f:
        rows = {line.split("`")[1]: line for line in f if line.startswith("| `")}
    for name in NAMES:
        cells = [c.strip() for c in rows[name].split("|")]
        assert cells[2] == str(scripts.fixture(name)["world_size"]), name
        assert cells[3].startswith(scripts.fixture(name)["verdict"]), name
