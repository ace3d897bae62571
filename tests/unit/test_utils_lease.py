"""The lease lock and the owner-alive rule shared by the --save writer lock, the kernel build lock
and the stale-temporary cleaner.

- an owner on this host is gone when its pid is gone or was reused (another start time, or a
  start after the owner was last seen active); another host's owner is never judged from here;
- a live holder is named (host, pid, since when) with the path to delete if it is gone;
- a dead or reused owner on this host is taken over at once; a silent heartbeat after
  stale_s, measured on the file system's clock whatever this host's clock says; a running
  owner on this host keeps its lease however silent unless the lock opts out;
- of two takers of one stale lease exactly one wins, and a taker that judged an older record
  leaves a lease that changed hands in place;
- the heartbeat moves the file's mtime and record; a holder notices when its lease was taken;
- a wait that lasts `notice_after_s` is logged once with path, holder and how to clear it.
"""
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from app.utils.fileio import fs_now
from app.utils.lease import Lease, LeaseHeld, LeaseOwner, read_owner
from app.utils.processes import process_gone, process_start


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_record(path, **fields):
    record = {"host": socket.gethostname(), "pid": os.getpid(), "token": "old", **fields}
    with open(path, "w") as f:
        json.dump(record, f)


def _age(path, seconds):
    """Make the file's last heartbeat `seconds` old on the file system's clock."""
    then = fs_now(os.path.dirname(path)) - seconds
    os.utime(path, (then, then))


def test_owner_alive_rule():
    me, host = os.getpid(), socket.gethostname()
    assert process_gone(host, me) is None
    assert process_gone(host, me, process_start(me)) is None
    assert "is gone" in process_gone(host, _dead_pid())
    assert "another process" in process_gone(host, me, process_start(me) - 3600)
    assert "started after" in process_gone(host, me, active_at=process_start(me) - 3600)
    assert process_gone(host, me, active_at=time.time()) is None
    assert process_gone("elsewhere", _dead_pid()) is None  # cannot be seen from here


def test_live_holder_is_named_and_released_only_by_itself(tmp_path):
    path = str(tmp_path / "x.lock")
    first = Lease(path, stale_s=60, heartbeat_s=60, extra={"command": "train --fake"})
    first.acquire()
    try:
        second = Lease(path, stale_s=60, heartbeat_s=60)
        assert not second.try_acquire()
        with pytest.raises(LeaseHeld) as err:
            second.acquire()
        message = str(err.value)
        assert f"host {socket.gethostname()}, pid {os.getpid()} (since " in message
        assert "command: train --fake" in message and f"delete {path}" in message
        second.release()  # never held: leaves the holder's file alone
        assert read_owner(path).token == first.token
    finally:
        first.release()
    assert not os.path.exists(path)
    with Lease(path, stale_s=60, heartbeat_s=60) as again:
        assert read_owner(path).token == again.token


@pytest.mark.parametrize("case", ["dead pid", "reused pid", "unreadable and old"])
def test_gone_owner_on_this_host_is_taken_over_at_once(tmp_path, case):
    path = str(tmp_path / "x.lock")
    if case == "unreadable and old":
        with open(path, "w") as f:
            f.write("{garbled")
        _age(path, 7200)
    else:
        fields = {"dead pid": dict(pid=_dead_pid()),
                  "reused pid": dict(process_start=process_start(os.getpid()) - 3600)}[case]
        _write_record(path, **fields)
    lease = Lease(path, stale_s=3600, heartbeat_s=60)
    start = time.monotonic()
    lease.acquire()
    try:
        assert time.monotonic() - start < 5 and read_owner(path).token == lease.token
        assert os.listdir(tmp_path) == ["x.lock"]  # the aside copy is gone
    finally:
        lease.release()


def test_silent_heartbeat_is_judged_on_the_file_systems_clock(tmp_path, monkeypatch):
    fresh, silent = str(tmp_path / "fresh.lock"), str(tmp_path / "silent.lock")
    _write_record(fresh, host="elsewhere", pid=1)
    _write_record(silent, host="elsewhere", pid=1)
    _age(silent, 120)
    real = time.time
    for skew in (3600.0, -3600.0):  # this host's clock an hour off the file server's
        monkeypatch.setattr(time, "time", lambda skew=skew: real() + skew)
        for path, stale in ((fresh, False), (silent, True)):
            lease = Lease(path, stale_s=60, heartbeat_s=10)
            assert (lease.stale_reason(lease.look()) is not None) == stale, (path, skew)


def test_running_owner_on_this_host_keeps_a_silent_lease_unless_the_lock_opts_out(tmp_path):
    path = str(tmp_path / "x.lock")
    _write_record(path, process_start=process_start(os.getpid()))
    _age(path, 600)
    trusting = Lease(path, stale_s=60, heartbeat_s=10)
    assert trusting.stale_reason(trusting.look()) is None
    strict = Lease(path, stale_s=60, heartbeat_s=10, trust_local_pid=False)
    assert "no heartbeat" in strict.stale_reason(strict.look())


def test_of_two_takers_exactly_one_wins(tmp_path):
    path = str(tmp_path / "x.lock")
    for _ in range(10):
        _write_record(path, pid=_dead_pid())
        takers = [Lease(path, stale_s=3600, heartbeat_s=60) for _ in range(2)]
        outcomes, gate = [], threading.Barrier(2)

        def take(lease):
            gate.wait()
            try:
                lease.acquire()
                outcomes.append("won")
            except LeaseHeld:
                outcomes.append("held")

        threads = [threading.Thread(target=take, args=(t,)) for t in takers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(outcomes) == ["held", "won"]
        winner = next(t for t in takers if t.token is not None)
        assert read_owner(path).token == winner.token
        winner.release()
        assert os.listdir(tmp_path) == []


def test_a_taker_that_judged_an_older_record_puts_the_new_one_back(tmp_path):
    path = str(tmp_path / "x.lock")
    _write_record(path, pid=_dead_pid())
    early, late = (Lease(path, stale_s=3600, heartbeat_s=60) for _ in range(2))
    judged = late.look()  # both judge the dead owner ...
    assert early.take_over(early.look(), "dead") and early.try_acquire()  # ... one takes it
    try:
        assert not late.take_over(judged, "dead")  # the other's judgement is out of date
        assert read_owner(path).token == early.token and not late.try_acquire()
        assert sorted(os.listdir(tmp_path)) == ["x.lock"]
    finally:
        early.release()


def test_heartbeat_moves_mtime_and_record_and_notices_a_lost_lease(tmp_path, caplog):
    path = str(tmp_path / "x.lock")
    lease = Lease(path, stale_s=60, heartbeat_s=0.05, what="test lock")
    lease.acquire()
    try:
        _age(path, 30)
        first = read_owner(path).heartbeat
        time.sleep(0.4)
        assert lease.look().age_s < 5 and read_owner(path).heartbeat > first
        os.remove(path)  # taken over: another holder's file appears
        _write_record(path, host="elsewhere", pid=1, token="theirs")
        with caplog.at_level(logging.WARNING, logger="app.utils.lease"):
            time.sleep(0.4)
        assert read_owner(path).token == "theirs"  # the old holder never writes into it
        lost = [r.getMessage() for r in caplog.records if "no longer names" in r.getMessage()]
        assert len(lost) == 1 and "the test lock" in lost[0] and "host elsewhere" in lost[0]
    finally:
        lease.release()
    assert read_owner(path).token == "theirs"


def test_a_long_wait_is_logged_once_with_holder_and_fix(tmp_path, caplog):
    path = str(tmp_path / "x.lock")
    _write_record(path, host="elsewhere", pid=77, started=time.time() - 60)
    lease = Lease(path, stale_s=0.5, heartbeat_s=0.05, notice_after_s=0.1, what="test lock")
    with caplog.at_level(logging.WARNING, logger="app.utils.lease"):
        lease.acquire()  # watches the silent heartbeat, then takes it over
    lease.release()
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]
    assert len(waits) == 1, waits
    assert f"the test lock {path}" in waits[0] and "host elsewhere, pid 77 (since " in waits[0]
    assert f"delete {path}" in waits[0]
    taken = [r.getMessage() for r in caplog.records if r.getMessage().startswith("took over")]
    assert len(taken) == 1 and "did not advance" in taken[0]


def test_owner_records_round_trip_and_reject_nonsense():
    owner = LeaseOwner.of_this_process({"command": "x"})
    assert LeaseOwner.from_json(json.loads(json.dumps(owner.to_json()))) == owner
    for bad in ([], {"host": "h"}, {"host": "h", "pid": "1"}, {"host": "h", "pid": True},
                {"host": 1, "pid": 1}, {"host": "h", "pid": 1, "started": "now"}):
        assert LeaseOwner.from_json(bad) is None, bad
