"""Build DeepSpeed's just-in-time ops of this machine ahead of their first use.

    python scripts/lib/deepspeed_ops.py ShareMemCommBuilder CPUAdamBuilder

DeepSpeed compiles the C++ ops it needs the first time a process loads them (torch's
cpp_extension, with ninja, into $TORCH_EXTENSIONS_DIR); on a CPU machine every DeepSpeed start
loads `deepspeed_shm_comm` and ZeRO-Offload loads `cpu_adam`: 64 and 91 s of CPU on a fresh
environment. The test set-up (`scripts/setup_env.sh --with-test-deps`, run by `scripts/test.sh`)
runs this in the background while pip installs the test requirements on one core, so the suite
finds them built. Each op is built exactly as DeepSpeed's own first use would build it (its
builder's `load()`, the same name, sources and flags), so that use finds it current; one that
DeepSpeed would not load here (another accelerator, an op its compatibility check refuses) is
skipped, as DeepSpeed would skip it.

An op whose build lock is held by no process (a killed build's leftover: every load would wait
for it forever) is not built: the lock and what to do are printed, and the exit status is 1.
Exit status 0 otherwise, 1 if a build failed (the first use will fail the same way and say why).
"""
from __future__ import annotations

import os
import sys


def build(names: list[str]) -> int:
    """Load each named op builder's op (building it if needed); 0 if all were fine, else 1."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    from app.launch import waits

    accelerator = get_accelerator()
    root = waits.extension_build_root()
    status = 0
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            print(f"[deepspeed_ops] {name}: DeepSpeed does not load it on this machine "
                  f"(accelerator {accelerator.device_name()}), skipped")
            continue
        lock = os.path.join(root, builder.NAME, "lock")
        stale = [held for held in waits.build_locks(root) if held.path == lock and held.stale]
        if stale:
            print(f"[deepspeed_ops] {name}: not built: {stale[0].describe()}")
            status = 1
            continue
        try:
            builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next op
            print(f"[deepspeed_ops] {name}: the build failed: {type(exc).__name__}: {exc}")
            status = 1
            continue
        print(f"[deepspeed_ops] {name}: {builder.NAME} built under {root}")
    return status


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(build(sys.argv[1:]))
