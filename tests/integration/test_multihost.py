"""Training across two hosts: two network namespaces joined by a veth pair (10.77.0.1 and
10.77.0.2), one `torchrun --nnodes 2` in each, no *_SOCKET_IFNAME set anywhere.

Inside each host the machine's host name resolves to a loopback address, as on clusters whose
/etc/hosts maps it so: gloo left to itself advertises 127.0.1.1 to the other host and cannot
connect. What must hold:
- native DP=2 and TP=2 and DeepSpeed ZeRO-2 across the hosts give the losses and grad norms of
  the same layout on one host (relative difference < 1e-6), each host having picked its veth;
- a host with no route to MASTER_ADDR stops before the process group with one line;
- a SIGKILL of the remote host's rank, and a network partition (the link down mid-run), stop
  both hosts within the collective timeout with exit code 4 and the one-line report, and a
  relaunch with --load once the link is back finishes with the losses and weights of an
  uninterrupted run, bit for bit.
"""
import itertools
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.harness.distributed import run_pretrain
from tests.harness.netns import HostsUnavailable, TestHosts
from tests.harness.corpus import ZERO2_DP2_ARGS, tiny_gpt_args
from tests.harness.launch import (ROOT, assert_close_curves, env, log_of, train_curve,
                                           wait_for_iteration)

SCRIPT = os.path.join(ROOT, "pretrain_gpt2.py")
ZERO2 = os.path.join(ROOT, "ds_configs", "zero2.json")
COMMON = ["--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--global-batch-size", "8", "--micro-batch-size", "2"]
SHORT = ["--train-iters", "8", *COMMON]
# long enough that a kill at iteration 10 and a partition 8 iterations after a resume land
# mid-run; a checkpoint every 4 iterations, collectives time out after 12 s
LONG = ["--train-iters", "120", "--save-interval", "4", "--distributed-timeout-minutes", "0.2",
        *COMMON]
TIMEOUT_S = 12
_ports = itertools.count(29500)


@pytest.fixture(scope="module")
def hosts():
    """Two test hosts for the whole module; skipped where namespaces cannot be made."""
    made = TestHosts(2)
    try:
        made.__enter__()
    except HostsUnavailable as exc:
        pytest.skip(f"two test hosts (network namespaces) cannot be made here: {exc}")
    try:
        # the cluster case: the host name resolves to loopback, so gloo's default is loopback
        name = made.run(1, [sys.executable, "-c", "import socket; print(socket.gethostbyname("
                            "socket.gethostname()))"], capture_output=True, text=True)
        assert name.stdout.strip().startswith("127."), name
        yield made
    finally:
        made.close()


def host_env():
    e = env()
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        e.pop(name, None)
    return e


def launch(hosts, workdir, nproc, args):
    """One `torchrun --nnodes 2` per host (node rank = host index), output in host<i>.log."""
    os.makedirs(workdir, exist_ok=True)
    port = str(next(_ports))
    procs = []
    for node in (0, 1):
        log = os.path.join(workdir, f"host{node}.log")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               f"--nproc-per-node={nproc}", "--node-rank", str(node), "--master-addr",
               hosts.addresses[0], "--master-port", port, SCRIPT, *args]
        with open(log, "w") as out:
            proc = hosts.popen(node, cmd, stdout=out, stderr=subprocess.STDOUT, env=host_env(),
                               cwd=workdir, start_new_session=True)
        proc.log = log
        procs.append(proc)
    return procs


def finish(procs, timeout=300):
    """Both launchers' exit codes; past `timeout` they are killed and the test fails."""
    deadline = time.time() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"launchers still running after {timeout} s:\n" +
                    "\n".join(log_of(p)[-3000:] for p in procs))


def run_across_hosts(hosts, workdir, nproc, args):
    """Launch on both hosts, require success, and check each host chose its own veth."""
    procs = launch(hosts, workdir, nproc, args)
    codes = finish(procs)
    logs = [log_of(p) for p in procs]
    assert codes == [0, 0], f"exit codes {codes}\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
    for node, log in enumerate(logs):
        assert f"GLOO_SOCKET_IFNAME={hosts.interfaces[node]} ({hosts.interfaces[node]} has " \
               f"{hosts.addresses[node]}" in log, log[-3000:]


def training_rank(launcher):
    """The pretrain_gpt2.py process under a torchrun launcher."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if SCRIPT in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no training process under launcher {launcher.pid}")


def assert_peer_failure(log, rank):
    """The rank exited 4 with the one-line report naming itself and the failed collective."""
    assert re.search(rf"rank\s+: {rank} \(local_rank: 0\)\s+exitcode\s+: 4 ", log), log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith(f"error: rank {rank} (host")]
    assert len(lines) == 1 and "a collective failed in '" in lines[0], log[-3000:]


def single_host_curve(corpus, tmp, nproc, args):
    """The curve of `args` on `nproc` ranks of this host (forked: the reference's launcher does
    not matter)."""
    metrics = tmp / "metrics.jsonl"
    run_pretrain(nproc, tiny_gpt_args(corpus, tmp, *args, "--metrics-file", str(metrics)))
    return train_curve(metrics)


@pytest.fixture(scope="module")
def dp2_across_hosts(hosts, tiny_corpus, tmp_path_factory):
    """An uninterrupted DP=2 run of LONG across the hosts: its curve and checkpoints."""
    tmp = tmp_path_factory.mktemp("dp2_hosts")
    run_across_hosts(hosts, tmp, 1, tiny_gpt_args(tiny_corpus, tmp, *LONG, "--save",
                                                  str(tmp / "ck"), "--metrics-file",
                                                  str(tmp / "metrics.jsonl")))
    return {"curve": train_curve(tmp / "metrics.jsonl"), "checkpoint": tmp / "ck"}


def test_data_parallel_across_hosts_matches_one_host(dp2_across_hosts, tiny_corpus,
                                                     tmp_path_factory):
    want = single_host_curve(tiny_corpus, tmp_path_factory.mktemp("dp2_one"), 2, LONG)
    assert_close_curves(dp2_across_hosts["curve"], want, rel=1e-6, what="DP=2 across hosts")


def test_tensor_parallel_across_hosts_matches_one_host(hosts, tiny_corpus, tmp_path):
    across, layout = tmp_path / "hosts", ["--tensor-model-parallel-size", "2"]
    run_across_hosts(hosts, across, 1, tiny_gpt_args(
        tiny_corpus, across, *SHORT, *layout, "--metrics-file", str(across / "metrics.jsonl")))
    want = single_host_curve(tiny_corpus, tmp_path, 2, [*SHORT, *layout])
    assert_close_curves(train_curve(across / "metrics.jsonl"), want, rel=1e-6,
                        what="TP=2 across hosts")


def test_zero2_across_hosts_matches_one_host(hosts, tiny_corpus, zero2_dp2_run, tmp_path):
    """DeepSpeed ZeRO-2 (its checkpoints written to the shared directory too) against the
    suite's one-host ZeRO-2 DP=2 run of the same flags."""
    run_across_hosts(hosts, tmp_path, 1, tiny_gpt_args(
        tiny_corpus, tmp_path, *ZERO2_DP2_ARGS, "--deepspeed", "--deepspeed_config", ZERO2,
        "--save", str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "metrics.jsonl")))
    assert_close_curves(train_curve(tmp_path / "metrics.jsonl"),
                        train_curve(zero2_dp2_run / "straight.jsonl"), rel=1e-6,
                        what="ZeRO-2 across hosts")


def test_no_interface_reaching_the_master_is_one_line_before_the_process_group(
        hosts, tiny_corpus, tmp_path):
    """A rank whose host has no route to MASTER_ADDR (an address outside the hosts' /24, so
    nothing is sent) exits 2 with one line naming MASTER_ADDR, the interfaces and the fix."""
    launcher = dict(host_env(), RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="10.77.1.1", MASTER_PORT="29500")
    proc = hosts.run(1, [sys.executable, SCRIPT, *tiny_gpt_args(tiny_corpus, tmp_path, *SHORT)],
                     env=launcher, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0] == (
        "error: no network interface of this host reaches MASTER_ADDR 10.77.1.1 (Network is "
        "unreachable), and the ranks span hosts (LOCAL_WORLD_SIZE 1 < WORLD_SIZE 2): set "
        "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) to the interface that reaches the "
        "master host, or give every host the master's reachable address (torchrun "
        "--master-addr, deepspeed --master_addr, MASTER_ADDR for mpirun); interfaces seen: "
        f"lo 127.0.0.1; {hosts.interfaces[1]} {hosts.addresses[1]}")
    assert "Traceback" not in proc.stderr


def test_kill_and_partition_stop_both_hosts_and_the_job_resumes_exactly(
        hosts, tiny_corpus, dp2_across_hosts, tmp_path):
    ck = tmp_path / "ck"
    want = dp2_across_hosts["curve"]

    def args(run, *extra):
        return tiny_gpt_args(tiny_corpus, tmp_path, *LONG, "--save", str(ck), "--metrics-file",
                             str(tmp_path / run / "metrics.jsonl"), *extra)

    # SIGKILL of the remote host's rank: host 0's rank stops at once with exit 4
    procs = launch(hosts, tmp_path / "killed", 1, args("killed"))
    wait_for_iteration(tmp_path / "killed" / "metrics.jsonl", 10, procs)
    training_rank(procs[1]).kill()
    start = time.time()
    codes = finish(procs, timeout=120)
    waited = time.time() - start
    assert codes[0] != 0 and codes[1] != 0 and waited < TIMEOUT_S + 48, (codes, waited)
    assert_peer_failure(log_of(procs[0]), 0)
    print(f"kill -9 of host 1's rank: both hosts stopped after {waited:.1f} s")
    assert re.search(r"rank\s+: 1 \(local_rank: 0\)\s+exitcode\s+: -9 ", log_of(procs[1]))

    # resumed, then the link goes down: both hosts stop within the timeout with exit 4
    resumed_from = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert resumed_from >= 8
    procs = launch(hosts, tmp_path / "partitioned", 1, args("partitioned", "--load", str(ck)))
    wait_for_iteration(tmp_path / "partitioned" / "metrics.jsonl", resumed_from + 8, procs)
    hosts.link_down(1)
    start = time.time()
    try:
        codes = finish(procs, timeout=120)
        waited = time.time() - start
    finally:
        hosts.link_up(1)
    # the collective timeout, then the report (a store read of at most 5 s) and the exits,
    # on a loaded 2-core machine
    assert codes[0] != 0 and codes[1] != 0 and TIMEOUT_S - 2 < waited < TIMEOUT_S + 48, \
        (codes, waited)
    for node, proc in enumerate(procs):
        assert_peer_failure(log_of(proc), node)
    print(f"partition: both hosts stopped after {waited:.1f} s (timeout {TIMEOUT_S} s)")

    # link back: the last relaunch finishes as the uninterrupted run did
    run_across_hosts(hosts, tmp_path / "healed", 1, args("healed", "--load", str(ck)))
    for run in ("killed", "partitioned", "healed"):
        got = train_curve(tmp_path / run / "metrics.jsonl")
        for it in sorted(got):
            assert got[it] == want[it], f"{run}: iteration {it}: {got[it]} != {want[it]}"
    assert max(got) == 120
    assert_same_weights(ck, dp2_across_hosts["checkpoint"])


def assert_same_weights(got_dir, want_dir):
    import torch
    from app.checkpoint.legacy import per_rank as ckpt
    got, got_iteration = ckpt.load_checkpoint_dict(str(got_dir))
    want, want_iteration = ckpt.load_checkpoint_dict(str(want_dir))
    assert got_iteration == want_iteration
    got_weights = ckpt.from_megatron_model(got["model"])
    want_weights = ckpt.from_megatron_model(want["model"])
    assert sorted(got_weights) == sorted(want_weights)
    for name, tensor in want_weights.items():
        assert torch.equal(got_weights[name], tensor), name
