"""Start-up never waits silently: a wait says within seconds what it waits for and the fix.

- A `lock` file that a killed build left in the torch extension directory of the op DeepSpeed
  builds at start (its CPU communication op) made every later `--deepspeed` start wait forever
  after the `> precision:` line, without a word. Now the stale lock is named at once, and the
  wait is reported while it lasts, with the path, its age and `rm <path>`.
- A rank whose rank 0 never comes says that it waits for rank 0 at MASTER_ADDR:MASTER_PORT.
"""
import os
import re
import signal
import subprocess
import sys
import time

from app.launch.ports import free_port
from tests.harness.corpus import tiny_gpt_args
from tests.harness.launch import ROOT, env

SCRIPT = os.path.join(ROOT, "pretrain_gpt2.py")


def read_until(proc, log, wanted, timeout):
    """Wait until every string of `wanted` is in `log` (or the process ends, or time runs
    out); return the log's text."""
    deadline, text = time.time() + timeout, ""
    while time.time() < deadline:
        with open(log, errors="replace") as f:
            text = f.read()
        if all(w in text for w in wanted) or proc.poll() is not None:
            break
        time.sleep(0.2)
    return text


def test_deepspeed_start_names_a_stale_extension_build_lock(tiny_corpus, tmp_path):
    extensions = tmp_path / "torch_extensions"  # never the user's ~/.cache
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "2", "--deepspeed",
                         "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json"))
    log = str(tmp_path / "run.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, *args], stdout=out, stderr=subprocess.STDOUT,
            env=dict(env(), TORCH_EXTENSIONS_DIR=str(extensions), APP_STARTUP_WAIT_REPORT_S="2"),
            cwd=tmp_path, start_new_session=True)
    try:
        found = f"stale build lock: the torch extension build lock {lock}"
        waited = " s (since "  # "start-up has waited 2 s (since 08:46:29) for ..."
        text = read_until(proc, log, [found, waited, f"rm {lock}"], timeout=120)
        assert proc.poll() is None, f"the run ended ({proc.returncode}):\n{text[-3000:]}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # it waits on the lock: no build is cut short
        proc.wait()
    assert found in text and "is held by no process on this host" in text, text[-3000:]
    report = next(line for line in text.splitlines() if waited in line)
    assert re.search(r"start-up has waited \d+ s \(since \d\d:\d\d:\d\d\) for "
                     r"deepspeed\.init_distributed", report), report
    assert f"rm {lock}" in report, report
    assert text.index("> precision:") < text.index(found)
    assert sorted(os.listdir(lock.parent)) == ["lock"]  # nothing was built there


def test_a_rank_without_its_rank0_says_what_it_waits_for(tmp_path):
    port = free_port("127.0.0.1")
    code = ("from app.launch.distributed import init_distributed; "
            "init_distributed('gloo', timeout_minutes=0.05)")
    world = dict(env(), RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), APP_STARTUP_WAIT_REPORT_S="1")
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
        world.pop(name, None)  # a plain launch: rank 0 hosts the store
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=world, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0  # the store's timeout (3 s) ends the wait
    assert re.search(r"start-up has waited \d+ s \(since [\d:]+\) for the rendezvous at "
                     rf"127\.0\.0\.1:{port} \(rank 1 of 2\): waiting for rank 0 at "
                     rf"127\.0\.0\.1:{port}, which does not answer", proc.stderr), (
        proc.stderr[-3000:])
