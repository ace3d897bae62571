"""The test harness reads each forked child's own exit code even when several threads start
and wait for children at once (run_main's pool of two, ForkedPython's server threads).

CPython's forkserver children report their exit code as 8 bytes on a pipe, and every
Process.start() polls the other live children: without tests.harness.distributed's lock two
threads could read one child's pipe together, and the loser recorded 255 (seen in CI as a
dry run "exiting 255" that had returned 2). Raw Process.start()/join() from four threads got
20 of 300 codes wrong on this machine; the harness's start_child/wait_child must get none.
"""
from concurrent.futures import ThreadPoolExecutor

from tests.harness.distributed import _context, start_child, wait_child


def _exit_with(code: int) -> None:
    raise SystemExit(code)


def _one(number: int) -> tuple:
    proc = _context().Process(target=_exit_with, args=(number % 7,))
    start_child(proc)
    return wait_child(proc, 60), number % 7


def test_exit_codes_of_children_started_and_waited_for_from_four_threads():
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(_one, range(240)))
    wrong = [(got, wanted) for got, wanted in outcomes if got != wanted]
    assert not wrong, f"{len(wrong)} of {len(outcomes)} exit codes wrong: {wrong[:10]}"
