"""A private Slurm cluster for tests: munged, slurmctld and one slurmd per test host.

    with TestHosts(2) as hosts, SlurmCluster(hosts) as cluster:
        job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "script.sh"], env=env)
        state = cluster.wait(job)                # "COMPLETED", "FAILED", ...

Debian's `slurm-wlm` and `munge` packages (scripts/setup_env.sh --with-test-deps installs them).
Everything lives in a new folder under /tmp (munge wants every folder above its socket
searchable, which pytest's 0700 temporary folders are not): the munge key and socket, slurm.conf,
the controller's state, each node's spool, the logs. Every daemon runs inside a test host
(tests.harness.netns), so its ports are the host's own and nothing clashes with this machine's
services: munged and slurmctld in host 0, and node `node<i+1>` (slurmd -N) in host i with that
host's address. The node names resolve in every host (its /etc/hosts), as on a cluster whose
DNS knows its nodes. Each node offers `cpus` CPUs whatever the machine has
(SlurmdParameters=config_overrides); no cgroups, no accounting database.

`close()` (and leaving the `with` block, also on an error) cancels the jobs, stops every daemon
by its pid (SIGTERM, then SIGKILL after a few seconds) and removes the folder; the test hosts'
own close() then kills anything left inside them (job steps, tasks).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence

from tests.harness.netns import TestHosts

COMMANDS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol",
            "squeue", "sinfo", "scancel")
"""The programs the cluster and its tests need."""

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED")
"""Job states after which a job runs no more (a requeued job goes back to PENDING instead)."""

CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"
"""No plugin here uses cgroups, but slurmd loads the cgroup plugin at start and autodetection
fails inside a test host (`ip netns exec` mounts a fresh /sys without the cgroup folders)."""

CONTROLLER_PORT = 6817
NODE_PORT = 6818


class SlurmUnavailable(RuntimeError):
    """No Slurm cluster can be started here; the message says why."""


def unavailable_reason() -> Optional[str]:
    """Why a cluster cannot be started here (not root, a program missing), or None."""
    if os.geteuid() != 0:
        return "slurmd and munged run as root in these tests"
    missing = [c for c in COMMANDS if shutil.which(c) is None
               and not os.path.exists(os.path.join("/usr/sbin", c))]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; "
                "scripts/setup_env.sh --with-test-deps does it as root)")
    return None


def _conf(folder: str, names: Sequence[str], addresses: Sequence[str], cpus: int,
          kill_wait_s: int) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                      for n, a in zip(names, addresses))
    return f"""# written by tests.harness.slurm for one test session
ClusterName=apptest
SlurmctldHost={socket.gethostname().split(".")[0]}({addresses[0]})
SlurmctldPort={CONTROLLER_PORT}
SlurmdPort={NODE_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={kill_wait_s}
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
Waittime=0
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """One node per test host of `hosts`; see the module doc. `names[i]` is host i's node."""

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: TestHosts, cpus: int = 2, kill_wait_s: int = 30,
                 start_timeout_s: float = 60.0) -> None:
        self.hosts, self.cpus, self.kill_wait_s = hosts, cpus, kill_wait_s
        self.start_timeout_s = start_timeout_s
        self.names = [f"node{i + 1}" for i in range(len(hosts.names))]
        self.folder = ""
        self._daemons: List[subprocess.Popen] = []

    # ------------------------------------------------------------------ set-up / tear-down

    def __enter__(self) -> "SlurmCluster":
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def conf(self) -> str:
        return os.path.join(self.folder, "slurm.conf")

    def _start(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="apptest-slurm-", dir="/tmp")
        os.chmod(self.folder, 0o755)
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.names)):
            os.makedirs(os.path.join(self.folder, sub), mode=0o755, exist_ok=True)
        key = os.path.join(self.folder, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        with open(self.conf, "w") as f:
            f.write(_conf(self.folder, self.names, self.hosts.addresses, self.cpus,
                          self.kill_wait_s))
        with open(os.path.join(self.folder, "cgroup.conf"), "w") as f:
            f.write(CGROUP_CONF)
        self.hosts.add_host_names(dict(zip(self.names, self.hosts.addresses)))
        munge = os.path.join(self.folder, "munge")
        self._daemon(0, "munged", ["munged", "-F", "--force", f"--socket={munge}/munge.socket",
                                   f"--key-file={key}", f"--log-file={munge}/munged.log",
                                   f"--pid-file={munge}/munged.pid",
                                   f"--seed-file={munge}/munged.seed"])
        self._wait_for(lambda: os.path.exists(f"{munge}/munge.socket"), "munged's socket")
        self._daemon(0, "slurmctld", ["slurmctld", "-D", "-f", self.conf])
        for i, name in enumerate(self.names):
            self._daemon(i, f"slurmd.{name}", ["slurmd", "-D", "-f", self.conf, "-N", name])
        self._wait_for(self.nodes_idle, "every node idle in sinfo")

    def _daemon(self, host: int, name: str, argv: List[str]) -> None:
        out = open(os.path.join(self.folder, "log", f"{name}.out"), "w")
        proc = self.hosts.popen(host, argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env(),
                                start_new_session=True)
        out.close()
        proc.name = name  # type: ignore[attr-defined]
        self._daemons.append(proc)

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.time() + self.start_timeout_s
        while time.time() < deadline:
            dead = [p.name for p in self._daemons if p.poll() is not None]  # type: ignore
            if dead:
                raise SlurmUnavailable(f"{', '.join(dead)} exited while waiting for {what}:\n"
                                       + self.logs())
            if ready():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"no {what} after {self.start_timeout_s:g} s:\n" + self.logs())

    def nodes_idle(self) -> bool:
        """Whether every node is idle in sinfo (up, no job running or completing on it)."""
        proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(n) == "idle" for n in self.names)

    def logs(self, tail: int = 2000) -> str:
        """The end of every daemon's log, for failure messages."""
        parts = []
        for name in sorted(os.listdir(os.path.join(self.folder, "log"))):
            with open(os.path.join(self.folder, "log", name), errors="replace") as f:
                parts.append(f"--- {name}\n{f.read()[-tail:]}")
        return "\n".join(parts)

    def close(self) -> None:
        """Cancel the jobs, stop every daemon by pid and remove the folder (never raises)."""
        if self._daemons and all(p.poll() is None for p in self._daemons):
            self.run(["scancel", "--full", "--partition=test"], check=False, timeout=10)
        for proc in reversed(self._daemons):  # the nodes first, munged last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 5.0
        for proc in self._daemons:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons.clear()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""

    # ------------------------------------------------------------------ use

    def env(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """`base` (default: this process's environment) with SLURM_CONF naming this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    def run(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
            check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm command (sbatch, srun, scontrol, ...) on node 1; output captured.
        `check` raises AssertionError with the output when it fails."""
        try:
            proc = self.hosts.run(0, argv, env=self.env(env), capture_output=True, text=True,
                                  timeout=timeout, **kwargs)
        except subprocess.TimeoutExpired as exc:
            if check:
                raise AssertionError(f"{' '.join(argv)} still running after {timeout} s") from exc
            return subprocess.CompletedProcess(argv, 124, "", "timeout")
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n"
                                 f"{proc.stderr}")
        return proc

    def sbatch(self, args: Sequence[str], env: Optional[Mapping[str, str]] = None,
               cwd: Optional[str] = None) -> str:
        """Submit a batch job (`sbatch --parsable ARGS`); returns its id."""
        proc = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """`scontrol show job` of `job_id` as a dict (JobState, ExitCode, Restarts, ...)."""
        proc = self.run(["scontrol", "show", "job", "-o", job_id])
        fields: Dict[str, str] = {}
        for token in proc.stdout.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait(self, job_id: str, timeout: float = 300, restarts: int = 0) -> Dict[str, str]:
        """Wait until job `job_id` has ended (after `restarts` requeues); returns its fields.
        Raises AssertionError with the daemons' logs after `timeout` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            fields = self.job(job_id)
            if (fields.get("JobState") in TERMINAL_STATES
                    and int(fields.get("Restarts", "0")) >= restarts):
                return fields
            time.sleep(0.25)
        raise AssertionError(f"job {job_id} not ended after {timeout} s: {self.job(job_id)}\n"
                             + self.logs())


__all__ = ["SlurmCluster", "SlurmUnavailable", "TERMINAL_STATES", "unavailable_reason"]
