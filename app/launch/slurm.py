"""Slurm: a task's place in the world, from the variables `srun` gives it (no scontrol needed).

`srun` starts every task with SLURM_PROCID (its rank in the step), SLURM_NTASKS (the step's
tasks), SLURM_LOCALID (its index on its node), SLURM_NODEID (its node's index in the step),
SLURM_STEP_TASKS_PER_NODE (tasks per node, compressed: "2(x3),1") and SLURM_STEP_NODELIST
(Slurm's host-list syntax: "gpu[01-04,07],login1"). A batch script itself runs outside any step:
it has SLURM_JOB_ID and SLURM_NTASKS (the job's), but no SLURM_STEP_ID.

- `step_from_environment` reads one task's step; `master_endpoint` picks the rendezvous: the
  first host of the step's node list (where task 0 runs with Slurm's block and cyclic
  distributions) and a port derived from the job id, so every task computes the same pair
  without talking to any other; MASTER_ADDR / MASTER_PORT, when exported, win.
- `check_launcher_in_step` and `check_exported_world` refuse the mistakes that start a wrong
  world (`SlurmLaunchError`, one line with the fix): a launcher (torchrun, the deepspeed
  launcher) in each of several tasks of a node (Megatron-LM #1371), a launcher whose node count
  is not the step's task count (each node trains alone), and RANK / WORLD_SIZE exported with
  values other than Slurm's.
- `exit_duration_from_end_time` turns the job's end (SLURM_JOB_END_TIME, Slurm 23.02 and later;
  the batch scripts export it from squeue on older Slurm) into `--exit-duration-in-mins`.

Pure functions of an environment mapping: app.launch.distributed applies them.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

PORT_BASE = 15000
PORT_SPAN = 15000
"""Rendezvous ports derived from job ids lie in [PORT_BASE, PORT_BASE + PORT_SPAN): below
Linux's ephemeral range (32768-60999), so no outgoing connection holds one by chance."""

EXIT_MARGIN_FRACTION = 0.2
"""The margin before the job's end is at most this fraction of the time left."""


class SlurmLaunchError(ValueError):
    """The tasks Slurm started do not make the world the run needs; the message says the fix."""


# ---------------------------------------------------------------------------- Slurm's syntax

def _split_top_level(text: str) -> List[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth < 0:
            raise ValueError(f"host list {text!r}: a ']' without its '['")
        if depth > 1:
            raise ValueError(f"host list {text!r}: nested brackets")
    if depth:
        raise ValueError(f"host list {text!r}: a '[' is not closed")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str, text: str) -> List[str]:
    """"01-03" -> ["01", "02", "03"]; "7" -> ["7"]. Numbers keep the width of the first bound
    when it has a leading zero, as Slurm writes them."""
    low, sep, high = spec.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise ValueError(f"host list {text!r}: {spec!r} is not a number or a range a-b")
    if not sep:
        return [low]
    if int(high) < int(low):
        raise ValueError(f"host list {text!r}: range {spec!r} runs backwards")
    width = len(low) if low.startswith("0") else 0
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def _expand_host(pattern: str, text: str) -> List[str]:
    """One host pattern, any number of bracket groups: "r[1-2]n[1,3]" -> r1n1 r1n3 r2n1 r2n3."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise ValueError(f"host list {text!r}: a ']' without its '['")
        return [pattern]
    close_at = pattern.find("]", open_at)
    head, body, tail = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    values = [v for spec in body.split(",") for v in _expand_range(spec.strip(), text)]
    return [head + value + rest for value in values for rest in _expand_host(tail, text)]


def expand_hostlist(text: str) -> List[str]:
    """Slurm's compressed host list as host names, in order:
    "gpu[01-03,07],login1" -> ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]. ValueError
    names the text when it is not Slurm's syntax."""
    return [host for part in _split_top_level(text) for host in _expand_host(part, text)]


def expand_tasks_per_node(text: str) -> List[int]:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE per node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"tasks per node {text!r}: {part!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def job_port(job_id: int) -> int:
    """The rendezvous port of job `job_id` (the same in every task and after a requeue)."""
    return PORT_BASE + job_id % PORT_SPAN


# ---------------------------------------------------------------------------- one task's step

@dataclass(frozen=True)
class SlurmStep:
    """One task of an `srun` job step, as its environment describes it."""

    job_id: int
    step_id: str
    procid: int
    """SLURM_PROCID: this task's rank in the step."""
    ntasks: int
    """SLURM_NTASKS: the step's tasks."""
    localid: int
    """SLURM_LOCALID: this task's index on its node."""
    node_index: int
    """SLURM_NODEID: this node's index in the step."""
    node_tasks: int
    """Tasks of the step on this node (SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID)."""
    nodes: Tuple[str, ...]
    """The step's nodes (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), expanded."""
    node_name: str
    """SLURMD_NODENAME: the node this task runs on."""
    restart_count: int
    """SLURM_RESTART_COUNT: how often the job was requeued (0 on its first start)."""

    def job_text(self) -> str:
        """"Slurm job 12 step 0" plus ", restart 2 (SLURM_RESTART_COUNT)" after requeues."""
        text = f"Slurm job {self.job_id} step {self.step_id}"
        return text + (f", restart {self.restart_count} (SLURM_RESTART_COUNT)"
                       if self.restart_count else "")


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = environ.get(name, "")
    if value.strip().lstrip("-").isdigit():
        return int(value)
    if default is None:
        raise SlurmLaunchError(f"{name}={value!r} is not a number; this process does not look "
                               "like an srun task (unset the SLURM_* variables to run without "
                               "Slurm)")
    return default


def in_job(environ: Mapping[str, str]) -> bool:
    """Whether this process runs inside a Slurm job (batch script, salloc shell or step)."""
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


def in_step(environ: Mapping[str, str]) -> bool:
    """Whether `srun` started this process (SLURM_STEP_ID and SLURM_PROCID set): not in a batch
    script, an salloc shell or outside Slurm."""
    return (bool(environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID"))
            and "SLURM_PROCID" in environ and in_job(environ))


def step_from_environment(environ: Mapping[str, str]) -> Optional[SlurmStep]:
    """This task's step when `srun` started it (`in_step`), else None."""
    if not in_step(environ):
        return None
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or ""
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST") or "")
    try:
        nodes = tuple(expand_hostlist(nodelist))
        per_node = expand_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE")
                                         or environ.get("SLURM_TASKS_PER_NODE") or "1")
    except ValueError as exc:
        raise SlurmLaunchError(f"{exc} (from Slurm's environment)") from exc
    node_index = _int(environ, "SLURM_NODEID", 0)
    if not nodes or node_index >= len(per_node):
        raise SlurmLaunchError(
            f"SLURM_NODEID={node_index} but the step lists nodes {nodelist!r} and tasks per "
            f"node {per_node}: this process does not look like an srun task (unset the "
            "SLURM_* variables to run without Slurm)")
    return SlurmStep(job_id=_int(environ, "SLURM_JOB_ID", _int(environ, "SLURM_JOBID", 0)),
                     step_id=step_id, procid=_int(environ, "SLURM_PROCID"),
                     ntasks=_int(environ, "SLURM_NTASKS", sum(per_node)),
                     localid=_int(environ, "SLURM_LOCALID", 0), node_index=node_index,
                     node_tasks=per_node[node_index], nodes=nodes,
                     node_name=environ.get("SLURMD_NODENAME", ""),
                     restart_count=_int(environ, "SLURM_RESTART_COUNT", 0))


def master_endpoint(step: SlurmStep, environ: Mapping[str, str]) -> Tuple[str, int, str]:
    """(MASTER_ADDR, MASTER_PORT, where they came from) for a world of srun tasks: the exported
    values when set, else the step's first node and `job_port`. Task 0 checks that it runs on
    that node (a distribution that puts it elsewhere would leave every rank waiting)."""
    port = _int(environ, "MASTER_PORT", job_port(step.job_id))
    port_source = "MASTER_PORT" if environ.get("MASTER_PORT") else f"from job id {step.job_id}"
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"], port, f"MASTER_ADDR, port {port_source}"
    first = step.nodes[0]
    if step.procid == 0 and step.node_name and step.node_name != first:
        raise SlurmLaunchError(
            f"task 0 runs on {step.node_name}, not on the step's first node {first} "
            f"(SLURM_STEP_NODELIST {','.join(step.nodes)}): use srun's default block "
            "distribution (or --distribution=cyclic), or export MASTER_ADDR=<task 0's host>")
    return first, port, f"first host of the step's node list, port {port_source}"


# ---------------------------------------------------------------------------- misuse

def _launch_fix() -> str:
    return ("start one task per node that runs torchrun (srun --ntasks-per-node=1 python -m "
            "torch.distributed.run --nnodes $SLURM_NNODES --node-rank $SLURM_NODEID "
            "--nproc-per-node <GPUs per node> ...), or no launcher and one task per GPU (srun "
            "--ntasks-per-node=<GPUs per node> python pretrain_gpt2.py ...); "
            "scripts/sbatch_pretrain_gpt2.sh does either (LAUNCHER=torchrun or srun)")


def check_launcher_in_step(step: SlurmStep, launcher: str, launcher_nodes: Optional[int]) -> None:
    """Refuse a `launcher` (torchrun, the deepspeed launcher) started by several tasks of one
    node, or one whose rendezvous counts `launcher_nodes` nodes while srun started a different
    number of tasks (one per node): in both, groups of ranks train apart."""
    where = step.node_name or f"node {step.node_index}"
    if step.node_tasks > 1:
        raise SlurmLaunchError(
            f"{launcher} is running inside each of the {step.node_tasks} Slurm tasks on {where} "
            f"(SLURM_STEP_TASKS_PER_NODE), so each starts its own ranks: {_launch_fix()}")
    if launcher_nodes is not None and launcher_nodes != step.ntasks:
        raise SlurmLaunchError(
            f"{launcher}'s rendezvous counts {launcher_nodes} node(s) but srun started "
            f"{step.ntasks} tasks, one per node (SLURM_NTASKS), so the nodes train apart: give "
            f"every {launcher} --nnodes $SLURM_NNODES --node-rank $SLURM_NODEID and the same "
            "master address and port")


def check_exported_world(step: SlurmStep, environ: Mapping[str, str]) -> None:
    """Refuse RANK / WORLD_SIZE exported without a launcher but different from what srun
    gives this task (SLURM_PROCID / SLURM_NTASKS): the ranks would not meet."""
    for name, slurm_name, want in (("WORLD_SIZE", "SLURM_NTASKS", step.ntasks),
                                   ("RANK", "SLURM_PROCID", step.procid)):
        if name in environ and environ[name].strip() != str(want):
            raise SlurmLaunchError(
                f"{name}={environ[name]} is exported but srun gives this task {slurm_name}="
                f"{want}: unset RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR in the job script "
                f"(the ranks then come from Slurm), or start the number of tasks the run needs "
                "(srun --ntasks / --nodes with --ntasks-per-node)")


def batch_shell_warning(environ: Mapping[str, str]) -> Optional[str]:
    """A warning when this process runs in a job of several tasks but outside srun (a batch
    script or salloc shell): it is a world of one and the other tasks stay idle."""
    tasks = _int(environ, "SLURM_NTASKS", 1) if in_job(environ) else 1
    if tasks <= 1:
        return None
    return (f"Slurm job {environ.get('SLURM_JOB_ID') or environ.get('SLURM_JOBID')} has "
            f"{tasks} tasks (SLURM_NTASKS) but this process was not started by srun: it runs "
            "as a world of one. Start it with `srun python pretrain_gpt2.py ...` (or use "
            "scripts/sbatch_pretrain_gpt2.sh)")


# ---------------------------------------------------------------------------- time limit

def exit_duration_from_end_time(environ: Mapping[str, str], now: float,
                                margin_minutes: float) -> Optional[Tuple[float, str]]:
    """(minutes, explanation) for --exit-duration-in-mins from the job's end: the time from
    `now` (seconds since the epoch) to SLURM_JOB_END_TIME, less `margin_minutes` or, when less
    time is left, less EXIT_MARGIN_FRACTION of it (to save and exit before Slurm kills the
    job). None outside a job with an end time. A job already past its end is an error."""
    end = environ.get("SLURM_JOB_END_TIME", "").strip()
    if not end or not in_job(environ):
        return None
    if not end.isdigit():
        raise SlurmLaunchError(f"SLURM_JOB_END_TIME={end!r} is not seconds since the epoch; "
                               "unset it, or give --exit-duration-in-mins")
    left = (int(end) - now) / 60.0
    if left <= 0:
        raise SlurmLaunchError(f"SLURM_JOB_END_TIME={end} is {-left:.1f} minutes in the past: "
                               "the job has no time left; give --exit-duration-in-mins")
    margin = min(margin_minutes, EXIT_MARGIN_FRACTION * left)
    minutes = left - margin
    return minutes, (f"SLURM_JOB_END_TIME: {left:.1f} minutes left in Slurm job "
                     f"{environ.get('SLURM_JOB_ID') or environ.get('SLURM_JOBID')}, less a "
                     f"margin of {margin:.1f} for the final checkpoint")


# ---------------------------------------------------------------------------- batch scripts

def job_layout(environ: Mapping[str, str]) -> Tuple[List[str], List[int], str, int]:
    """(the job's nodes, tasks on each, master host, master port) in a batch script: from
    SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE, MASTER_ADDR / MASTER_PORT when exported."""
    nodes = expand_hostlist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
                            or "")
    tasks = expand_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE") or "1")
    if not nodes or len(tasks) != len(nodes):
        raise SlurmLaunchError(
            f"SLURM_JOB_NODELIST {environ.get('SLURM_JOB_NODELIST')!r} and SLURM_TASKS_PER_NODE "
            f"{environ.get('SLURM_TASKS_PER_NODE')!r} do not describe the same nodes: run this "
            "inside a Slurm job (sbatch / salloc)")
    job_id = _int(environ, "SLURM_JOB_ID", _int(environ, "SLURM_JOBID", 0))
    return (nodes, tasks, environ.get("MASTER_ADDR") or nodes[0],
            _int(environ, "MASTER_PORT", job_port(job_id)))


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m app.launch.slurm torchrun|hostfile` for scripts/lib/slurm.sh, in a batch
    script: `torchrun` prints "NODES PROCS_PER_NODE MASTER_HOST MASTER_PORT" (one torchrun per
    node; every node must have the same task count), `hostfile` prints DeepSpeed hostfile lines
    ("host slots=N"). Errors: one line on stderr, exit status 2."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if args != ["torchrun"] and args != ["hostfile"]:
            raise SlurmLaunchError("usage: python -m app.launch.slurm torchrun|hostfile")
        nodes, tasks, host, port = job_layout(os.environ)
        if args == ["hostfile"]:
            print("\n".join(f"{node} slots={count}" for node, count in zip(nodes, tasks)))
        elif len(set(tasks)) != 1:
            raise SlurmLaunchError(
                f"the job has {','.join(map(str, tasks))} tasks on its nodes "
                f"(SLURM_TASKS_PER_NODE) but one torchrun per node starts the same number of "
                "ranks on each: submit with --ntasks-per-node")
        else:
            print(len(nodes), tasks[0], host, port)
    except SlurmLaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["SlurmLaunchError", "SlurmStep", "batch_shell_warning", "check_exported_world",
           "check_launcher_in_step", "exit_duration_from_end_time", "expand_hostlist",
           "expand_tasks_per_node", "in_job", "in_step", "job_layout", "job_port", "master_endpoint",
           "step_from_environment"]


if __name__ == "__main__":
    raise SystemExit(main())
