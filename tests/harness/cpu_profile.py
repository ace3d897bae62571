"""A pytest plugin that records what each test costs the machine, for keeping the suite fast.

    python -m pytest -p tests.harness.cpu_profile tests ...   (one worker: no -n)

Each test (setup, call and teardown together) appends a line to $TEST_CPU_PROFILE (default
cpu-profile.tsv in the working directory): its wall seconds and the CPU seconds the whole
machine spent meanwhile, from /proc/stat, so the processes a test starts, forks or leaves to a
forkserver all count, killed ones too. Run it with nothing else on the machine and without
xdist: the CPU column is then the test's own. `python -m tests.harness.cpu_profile FILE` sums it
by file, most CPU first.
"""
import os
import sys
import time
from collections import defaultdict

import pytest

_TICKS = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds spent by every process since boot, all CPUs (user, nice, system, irq; not
    steal: time the hypervisor gave to others)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
    return (user + nice + system + irq + softirq) / _TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, busy = time.monotonic(), _busy_seconds()
    yield
    wall, busy = time.monotonic() - wall, _busy_seconds() - busy
    with open(os.environ.get("TEST_CPU_PROFILE", "cpu-profile.tsv"), "a") as out:
        out.write(f"{wall:.2f}\t{busy:.2f}\t{item.nodeid}\n")


def summarize(path: str) -> str:
    """The profile summed by file: wall s, CPU s, CPU / wall, tests; most CPU first."""
    wall, cpu, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for line in open(path):
        w, c, nodeid = line.rstrip("\n").split("\t")
        name = nodeid.split("::")[0]
        wall[name] += float(w)
        cpu[name] += float(c)
        count[name] += 1
    rows = [f"{'wall s':>8} {'cpu s':>8} {'cpu/wall':>8} {'tests':>5}  file"]
    for name in sorted(cpu, key=cpu.get, reverse=True):
        rows.append(f"{wall[name]:8.1f} {cpu[name]:8.1f} {cpu[name] / max(wall[name], 1e-9):8.2f}"
                    f" {count[name]:5d}  {name}")
    rows.append(f"{sum(wall.values()):8.1f} {sum(cpu.values()):8.1f}  total")
    return "\n".join(rows)


if __name__ == "__main__":
    print(summarize(sys.argv[1] if len(sys.argv) > 1 else "cpu-profile.tsv"))
