"""How a save becomes the latest checkpoint, for both engines: crash-safe files and a two-phase
commit over every rank.

One file (`write_checked_file`, through `fileio.atomic_open`): written under a temporary name,
fsynced, its SHA-256 sidecar written, then renamed; `remove_written_file` is its undo. One save
(`commit_save`):

1. every rank writes its files durably (the engine's `write` step), then, with a `publish`
   step, the ranks exchange what they wrote and one writes the files naming them all;
2. the ranks agree that all of them succeeded, else every rank undoes its part (the engine's
   `undo` step, and the iteration directory when this save created it) and raises
   CheckpointSaveError, and the previous checkpoint stays the latest;
3. one rank writes DeepSpeed's `latest` (DeepSpeed engine) and our tracker, durably, then
   deletes old iterations beyond `keep_last_n`;
4. the ranks agree again, so the tracker names the new iteration on every rank's return.

So the tracker never names an iteration with a missing or partial file, and a crash at any
point leaves the previous checkpoint loadable. An asynchronous save (--async-save) splits this:
`start_save` copies the state (the engine's `capture`) and runs step 1 in a background thread;
`PendingSave.finish`, called later from the training thread on every rank, waits for it and
runs steps 2-4, so the collectives never leave the training thread and the pointer files move
only after every rank's files are durable. Each stage (`SAVE_STAGES`, in order) is the
fault-injection point `faults.SAVE_STAGE` (app/utils/faults.py), where the crash tests strike.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from app.checkpoint import CheckpointError, names
from app.checkpoint.files import read_checksums, sha256_file, sidecar_path, write_checksums
from app.launch.distributed import all_ranks_ok
from app.utils import faults
from app.utils.fileio import atomic_open

SAVE_STAGES = ("start", "rank_tmp_written", "rank_checksum_committed", "rank_file_committed",
               "before_tracker", "tracker_tmp_written", "tracker_committed", "rotated")
"""The stages of a save in order (the rank_* ones once per file written)."""

WriteStep = Callable[[], Optional[Tuple[str, OSError]]]
"""Writes this rank's files durably; returns (path, error) of the first file that could not
be written (a full disk), None when all were. Must not raise OSError."""

PublishStep = Callable[[bool], Optional[Tuple[str, OSError]]]
"""Runs on every rank in the training thread once its write step is over, before the ranks
agree, with whether this rank's write succeeded: a step that needs every rank's result (the
torch_dist format gathers what each rank wrote and one rank writes the global metadata).
Returns (path, error) when its own writing failed, None otherwise. Must not raise OSError."""


def save_stage(name: str) -> None:
    """This rank's save reached stage `name` (one of SAVE_STAGES): the fault-injection point
    (also for the torch_dist format's rank files, app.checkpoint.torch_dist.dcp_files)."""
    faults.fire(faults.SAVE_STAGE, name)


# ---------------------------------------------------------------------------- one file

def write_checked_file(path: str, write: Callable[[Any], Any], hidden_sidecar: bool = False
                       ) -> None:
    """Write `path` with `write(f)` crash-safely, with a SHA-256 sidecar (`sidecar_path`).

    `fileio.atomic_open` (durable): a temporary file, fsynced, then renamed; in between, the
    sidecar gets the new file's digest. Safe to crash at any point, and a failed write (a full
    disk) leaves no temporary file. While the data file is being replaced the sidecar lists
    both the old and the new digest, so whichever file is on disk after a crash still verifies.
    Used for Megatron's files and, through the checkpoint-engine hook of
    app.training.engines.deepspeed, for DeepSpeed's (hidden sidecars).
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sidecar, name = sidecar_path(path, hidden_sidecar), os.path.basename(path)
    digests: List[str] = []

    def list_new_digest(tmp: str) -> None:  # tmp is complete and durable; path not replaced yet
        save_stage("rank_tmp_written")
        digests.append(sha256_file(tmp))
        old = read_checksums(sidecar) if os.path.exists(path) else []
        digests.extend(d for d in old if d != digests[0])
        write_checksums(sidecar, name, digests)
        save_stage("rank_checksum_committed")

    try:
        with atomic_open(path, "wb", durable=True, before_replace=list_new_digest) as f:
            write(f)
    except RuntimeError as exc:  # torch.save's report of a failed write: an OSError here
        error = storage_error(exc, path)
        if error is None:
            raise
        raise error from exc
    if len(digests) > 1:  # the old file is gone: its digest no longer verifies anything
        write_checksums(sidecar, name, digests[:1])
    save_stage("rank_file_committed")


_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed",
                         "iostream error")
"""Fragments of the RuntimeError torch's zip writer raises when a write fails (on a full disk
`[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`)."""


def storage_error(exc: BaseException, path: str = "") -> Optional[OSError]:
    """The OSError behind a failed checkpoint write, or None when `exc` is not one.

    `exc` itself when it is an OSError (ENOSPC, EIO, EACCES, a TimeoutError); for torch's
    RuntimeError of a failed write (`_TORCH_WRITE_FAILURES`), the OSError it was raised while
    handling (torch.save into a file object: the file's own ENOSPC), else one made from its
    message: ENOSPC when the file system of `path` has under 1 MiB free, EIO otherwise.
    """
    if isinstance(exc, OSError):
        return exc
    if not isinstance(exc, RuntimeError) or not any(m in str(exc) for m in _TORCH_WRITE_FAILURES):
        return None
    cause: Optional[BaseException] = exc
    while cause is not None:
        if isinstance(cause, OSError):
            return OSError(cause.errno, cause.strerror or str(cause), path or cause.filename)
        cause = cause.__cause__ or cause.__context__
    code = errno.EIO
    with contextlib.suppress(OSError):
        if shutil.disk_usage(os.path.dirname(path) or ".").free < 2**20:
            code = errno.ENOSPC
    torch_says = str(exc).splitlines()[0][:200]
    return OSError(code, f"{os.strerror(code)} (torch: {torch_says})", path or None)


def remove_written_file(path: str, stop_at: str) -> None:
    """Delete `path` and its sidecar, then the directories above it up to (and including)
    `stop_at` that are left empty: the undo of a save that did not complete everywhere."""
    for victim in (path, sidecar_path(path, False), sidecar_path(path, True)):
        with contextlib.suppress(OSError):
            os.remove(victim)
    directory = os.path.dirname(path)
    stop_at = os.path.abspath(stop_at)
    while os.path.abspath(directory).startswith(stop_at):
        try:
            os.rmdir(directory)
        except OSError:
            return
        if os.path.abspath(directory) == stop_at:
            return
        directory = os.path.dirname(directory)


# ---------------------------------------------------------------------------- one save

class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written; its partial files were removed and the previous
    checkpoint stays the latest (the message says which)."""


def save_failure(save_dir: str, iteration: names.Iteration, error: Optional[BaseException],
                 path: str = "") -> CheckpointSaveError:
    """The error every rank raises after a failed save: this rank's own cause when it had one
    (`error`), else that another rank failed; with the free space and the latest checkpoint."""
    try:
        latest = names.read_tracker(save_dir)
    except CheckpointError:
        latest = None
    try:
        free = f"{shutil.disk_usage(save_dir).free / 2**20:.0f} MiB free there now"
    except OSError:
        free = "free space unknown"
    if error is None:
        cause = "another rank could not write its part (its message says why)"
    else:
        what = getattr(error, "strerror", None) or str(error)
        code = errno.errorcode.get(getattr(error, "errno", None) or -1, "")
        cause = f"writing {path or save_dir} failed: {what}{f' ({code})' if code else ''}"
    still = (f"the latest checkpoint is still iteration {latest}" if latest is not None
             else "there is no earlier checkpoint")
    return CheckpointSaveError(
        f"could not save the checkpoint of iteration {iteration} to {save_dir}: {cause}; "
        f"{free}. The partial files of this save were removed and {still}. Free space or fix "
        "the directory (a relaunch with --load resumes from the latest checkpoint).")


def rotate_checkpoints(save_dir: str, keep_last_n: int, current: int) -> List[int]:
    """Delete iter_ directories older than `current`, keeping the newest `keep_last_n` in all.

    Call only after the tracker names `current`. Directories newer than `current` (left by an
    abandoned run) and `release/` are never touched. Returns the iterations deleted.
    """
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n_checkpoints must be >= 1, got {keep_last_n}")
    older = [i for i in names.list_checkpoint_iterations(save_dir) if i < current]
    doomed = older[:max(0, len(older) - (keep_last_n - 1))]
    for iteration in doomed:
        shutil.rmtree(names.checkpoint_dir(save_dir, iteration), ignore_errors=True)
    return doomed


def world_agreement(device: Any) -> Callable[[bool], bool]:
    """`agree` for `commit_save` over every rank of the world (an all-reduce of one flag on
    `device`, also a barrier): whether `ok` held on all of them."""
    return lambda ok: all_ranks_ok(ok, device)


def commit_save(save_dir: str, iteration: names.Iteration, *, write: WriteStep,
                undo: Callable[[], None], agree: Callable[[bool], bool],
                is_tracker_writer: bool, keep_last_n: Optional[int] = None,
                deepspeed_latest: bool = False) -> str:
    """Make `iteration` the latest checkpoint under `save_dir` on every rank, or on none.

    Every rank calls this with its `write` step (a rank with nothing to write passes one that
    writes nothing) and the `undo` of it (remove the files it created, keep those it
    replaced). `agree(ok)` is called exactly twice on every rank and returns whether `ok` held
    on every rank (`world_agreement`). Only `is_tracker_writer` writes the pointer files:
    DeepSpeed's `latest` first when `deepspeed_latest`, then our tracker; then, with
    `keep_last_n`, it rotates old iterations ("release" is never rotated). A failure on any
    rank undoes this save on every rank and raises CheckpointSaveError (the tracker keeps
    naming the previous checkpoint, `latest` the tag it named before). Returns the iteration
    directory.
    """
    return start_save(save_dir, iteration, write=write, undo=undo, agree=agree,
                      is_tracker_writer=is_tracker_writer, keep_last_n=keep_last_n,
                      deepspeed_latest=deepspeed_latest).finish()


def start_save(save_dir: str, iteration: names.Iteration, *, write: WriteStep,
               undo: Callable[[], None], agree: Callable[[bool], bool],
               is_tracker_writer: bool, keep_last_n: Optional[int] = None,
               deepspeed_latest: bool = False, capture: Optional[Callable[[], None]] = None,
               background: bool = False, publish: Optional[PublishStep] = None
               ) -> "PendingSave":
    """Step 1 of `commit_save` (same arguments), its steps 2-4 left to `PendingSave.finish`
    (which runs `publish` first, in the calling thread).

    `capture` runs first in the calling thread (after the iteration directory was looked at):
    it copies the state that `write` will write, so training may change the live state once
    this returns. With `background` the `write` step runs in a thread of its own (it must
    then touch no collective and no live state); without, before this returns.
    """
    save_stage("start")
    directory = names.checkpoint_dir(save_dir, iteration)
    fresh = not os.path.isdir(directory)  # before any rank of this save can create it
    try:
        _mark_in_progress(directory)
        marked = None
    except OSError as exc:  # a full disk: agreed on in finish(), like a failed write
        marked = (directory, exc)
    if capture is not None:
        try:
            capture()
        except BaseException:
            _undo(undo, directory, fresh)  # a copy that failed half-way leaves nothing behind
            raise
    pending = PendingSave(save_dir, iteration, undo=undo, agree=agree,
                          is_tracker_writer=is_tracker_writer, keep_last_n=keep_last_n,
                          deepspeed_latest=deepspeed_latest, fresh=fresh, publish=publish,
                          failed=marked)
    pending.run(write, background)
    return pending


class PendingSave:
    """One save whose files are being written (or were): `finish` agrees and commits it.

    Made by `start_save`. `written()` says whether this rank's write step is over (always
    true for a synchronous save); `finish` waits for it, then runs steps 2-4 of
    `commit_save` from the calling thread (the only place with collectives). Call `finish`
    exactly once, on every rank alike.
    """

    def __init__(self, save_dir: str, iteration: names.Iteration, *, undo: Callable[[], None],
                 agree: Callable[[bool], bool], is_tracker_writer: bool,
                 keep_last_n: Optional[int], deepspeed_latest: bool, fresh: bool,
                 publish: Optional[PublishStep] = None,
                 failed: Optional[Tuple[str, OSError]] = None) -> None:
        self.save_dir, self.iteration = save_dir, iteration
        self.directory = names.checkpoint_dir(save_dir, iteration)
        self.agree = agree
        self._undo, self._fresh = undo, fresh
        self._tracker_writer, self._keep_last_n = is_tracker_writer, keep_last_n
        self._deepspeed_latest = deepspeed_latest
        self._publish = publish
        self._failed = failed  # (path, error) of this rank's first failure
        self._raised: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def run(self, write: WriteStep, background: bool) -> None:
        """Run this rank's `write` step, in a thread of its own with `background`. A write
        that fails on storage (`storage_error`: a full disk however torch reports it, EIO, a
        permission error, a timeout) is kept for `finish` to agree on, whichever step raised."""
        def attempt() -> None:  # runs even after a failed mark: DeepSpeed's barriers are in it
            try:
                failed = write()
            except Exception as exc:  # noqa: BLE001 - anything else propagates
                error = storage_error(exc, self.directory)
                if error is None:
                    raise
                failed = (self.directory, error)
            self._failed = self._failed or failed

        def step() -> None:
            try:
                attempt()
            except BaseException as exc:  # reported by finish(), in the training thread
                self._raised = exc
        if not background:
            attempt()  # another exception propagates at once, as it always did
            return
        self._thread = threading.Thread(target=step, name=f"checkpoint-write-{self.iteration}",
                                        daemon=True)
        self._thread.start()

    def abandon(self, timeout_s: float) -> None:
        """Give this save up on an exit path that cannot commit it (no collective): wait up
        to `timeout_s` for this rank's background write, then undo this rank's part; a write
        still running is left to die with the process (its mark lets the next run that
        claims --save remove it)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.written():
            _undo(self._undo, self.directory, self._fresh)

    def written(self) -> bool:
        """Whether this rank's write step is over (its files are durable or it failed)."""
        return self._thread is None or not self._thread.is_alive()

    def finish(self) -> str:
        """Wait for this rank's write, then steps 2-4 of `commit_save`: agree, undo everywhere
        or write the pointer files and rotate, agree again. Returns the iteration directory;
        raises CheckpointSaveError (or what the background write raised) after an undo."""
        if self._thread is not None:
            self._thread.join()
        ok = self._failed is None and self._raised is None
        if self._publish is not None:  # every rank, even after a failed write
            published = self._publish(ok)
            if published is not None and ok:
                self._failed, ok = published, False
        if not self.agree(ok):  # every rank's files of this iteration are complete, or none
            _undo(self._undo, self.directory, self._fresh)
            if self._raised is not None:
                raise self._raised
            path, error = self._failed or ("", None)
            raise save_failure(self.save_dir, self.iteration, error, path)
        error: Optional[OSError] = None
        previous_tag: Optional[str] = None
        if self._tracker_writer:
            save_stage("before_tracker")
            try:
                if self._deepspeed_latest:
                    previous_tag = names.read_latest_tag(self.save_dir) or ""
                    names.write_latest_tag(self.save_dir, names.iteration_tag(self.iteration))
                names.write_tracker(self.save_dir, self.iteration,
                                    before_replace=lambda _: save_stage("tracker_tmp_written"))
            except OSError as exc:
                error = exc
            else:
                save_stage("tracker_committed")
                if self._keep_last_n and self.iteration != names.RELEASE:
                    rotate_checkpoints(self.save_dir, self._keep_last_n, int(self.iteration))
                    save_stage("rotated")
        if not self.agree(error is None):  # the tracker names this iteration on every return
            if previous_tag is not None:
                _restore_latest(self.save_dir, previous_tag)
            _undo(self._undo, self.directory, self._fresh)
            raise save_failure(self.save_dir, self.iteration, error,
                               names.tracker_path(self.save_dir))
        _unmark(self.directory)
        return self.directory


def _restore_latest(save_dir: str, previous_tag: str) -> None:
    """Put DeepSpeed's `latest` back as it was before a save that is being undone: the tag it
    named, or no file when there was none (best effort: the tracker is what we load by)."""
    with contextlib.suppress(OSError):
        if previous_tag:
            names.write_latest_tag(save_dir, previous_tag)
        else:
            os.remove(os.path.join(save_dir, names.LATEST_FILENAME))


def _undo(undo: Callable[[], None], directory: str, fresh: bool) -> None:
    """Undo this rank's part of a failed save: its new files, and the iteration directory when
    this save created it (a rank that saw it missing before writing removes it all)."""
    undo()
    _unmark(directory)
    if fresh:
        shutil.rmtree(directory, ignore_errors=True)


def _mark_in_progress(directory: str) -> None:
    """This process's save-in-progress mark in `directory` (names.SAVE_MARKER_PREFIX), made
    before any file of the save, so a save killed before its commit is recognisable."""
    os.makedirs(directory, exist_ok=True)
    with open(names.save_marker_path(directory, socket.gethostname(), os.getpid()), "wb"):
        pass


def _unmark(directory: str) -> None:
    """Remove this process's save-in-progress mark (the save is committed or undone)."""
    with contextlib.suppress(OSError):
        os.remove(names.save_marker_path(directory, socket.gethostname(), os.getpid()))


class OneSaveAtATime:
    """`save_checkpoint`, `finish_save`, `abandon_save` and `save_in_flight` over a
    `start_save(save_dir, iteration, client_state, asynchronous) -> PendingSave` of the
    subclass: at most one save in flight, committed by `finish_save` on every rank alike (the
    engines, and the local checkpoints of app.training.checkpointing.local)."""

    _pending_save: Optional[PendingSave] = None
    """The save being written in the background, until finish_save commits it."""

    def start_save(self, save_dir: str, iteration: int, client_state: Any,
                   asynchronous: bool) -> PendingSave:
        """Begin this rank's part of a save of `iteration` (`start_save` of this module)."""
        raise NotImplementedError

    def save_checkpoint(self, save_dir: str, iteration: int, client_state: Dict[str, Any],
                        asynchronous: bool = False) -> str:
        """Write a checkpoint of `iteration` (all ranks call it); return the directory written.

        The save in flight, if any, is finished first (at most one at a time). With
        `asynchronous` this returns once the state is copied to host memory and this rank's
        files are being written in the background; `finish_save` commits it later.
        """
        self.finish_save()
        pending = self.start_save(save_dir, iteration, client_state, asynchronous)
        if not asynchronous:
            return pending.finish()
        self._pending_save = pending
        return pending.directory

    def finish_save(self, blocking: bool = True) -> Optional[str]:
        """Commit the save in flight on every rank (all ranks call it at the same point); its
        directory, or None when none was in flight or (not `blocking`) some rank is still
        writing. Not blocking costs one agreement over the ranks while a save is in flight."""
        pending = self._pending_save
        if pending is None or (not blocking and not pending.agree(pending.written())):
            return None
        self._pending_save = None
        return pending.finish()

    def abandon_save(self, timeout_s: float) -> None:
        """On an exit path that cannot commit (an error, no collective): end the save in
        flight, waiting up to `timeout_s` for its background writer, and remove this rank's
        files of it (commit.PendingSave.abandon); the tracker never named it."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.abandon(timeout_s)

    @property
    def save_in_flight(self) -> Optional[int]:
        """The iteration of the save being written in the background, or None."""
        return None if self._pending_save is None else self._pending_save.iteration
