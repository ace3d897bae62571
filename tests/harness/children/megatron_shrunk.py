"""One torchrun rank that trains several runs of pretrain_gpt.py in sequence, each in a forked
child with its own rendezvous port, so many shrunk launch scripts train under one torchrun
spawn (tests/integration/test_megatron_scripts.py).

    torchrun --nproc-per-node 2 megatron_shrunk.py SPEC.json

SPEC.json: {"runs": [{"name", "argv", "port", "log"}, ...], "timeout": seconds}. For each run
the rank forks; the child takes the run's MASTER_PORT (its own TCPStore: torchrun's agent
store is not used), sends its output to `log` with ".rank<R>" appended, and calls
pretrain_gpt.main(argv). The parent waits (killing a child past the timeout) and writes
{name: exit code} to SPEC.json's directory as exit_codes.rank<R>.json.
"""
import json
import os
import signal
import sys
import time


def _child(run: dict, rank: str) -> None:
    os.environ["MASTER_PORT"] = str(run["port"])
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    fd = os.open(f"{run['log']}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        import pretrain_gpt
        code = pretrain_gpt.main(run["argv"])
    except BaseException:  # noqa: BLE001 (the child reports every failure in its log)
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _warm_up() -> None:
    """Import once, before forking, what every run imports on first use (the parser's
    DeepSpeed flags, transformers' tokenizers, torch.compile's machinery behind the optimizer,
    TensorBoard, the profiler), so each forked run starts warm."""
    import torch._dynamo  # noqa: F401
    import torch.profiler  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import transformers  # noqa: F401

    import arguments
    import pretrain_gpt  # noqa: F401
    arguments.build_parser()
    transformers.AutoTokenizer  # noqa: B018 (resolves the lazy module)


def _wait(pid: int, timeout: float) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    rank = os.environ["RANK"]
    _warm_up()
    import torch
    torch.set_num_threads(1)
    codes = {}
    for run in spec["runs"]:
        pid = os.fork()
        if pid == 0:
            _child(run, rank)
        codes[run["name"]] = _wait(pid, spec["timeout"])
    with open(os.path.join(os.path.dirname(spec_path), f"exit_codes.rank{rank}.json"), "w") as f:
        json.dump(codes, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
