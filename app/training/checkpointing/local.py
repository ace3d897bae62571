"""Local (non-persistent) checkpoints with replicas, Megatron-LM's `--non-persistent-ckpt-type
local`: every few iterations each rank writes its own state to a disk of its own node.

Layout (rank r writes only under its own folder)::

    {--non-persistent-local-ckpt-dir}/rank_{r}/latest_checkpointed_iteration.txt
    {--non-persistent-local-ckpt-dir}/rank_{r}/iter_{iteration:07d}/state_rank_{o:05d}.pt (+ .sha256)

`state_rank_{o}` is rank o's whole state (the engine's `local_state`: weights, optimizer, LR
schedule; the RNG states and the run's position), o = r for its own and, with --replication,
the other members of r's replica group for the replicas r holds (`replica_group`: Megatron's
clique of K ranks J apart, so with J = ranks per node the replicas live on other nodes). A save
(`LocalCheckpoints.start_save`) copies the state to host memory in the training thread; a
background thread serializes it, exchanges it with the replica group (over a gloo group of
the clique's own, used by that thread only) and writes the files, through the same two-phase
commit as persistent saves (app.checkpoint.commit: durable files with SHA-256 sidecars, all
ranks agree, each rank's own tracker, the previous local iteration removed once the new one
commits). The run's checkpointer (app.training.checkpointing.checkpointer) drives it through a
`CheckpointSaver` of its own, whose failures count like persistent ones
(app.training.checkpointing.saver).

On resume and on a --rollback-on-spike (the one choice of app.training.checkpointing.latest:
`pick_newest` here, then `load_pick`) the candidates are ranked by iteration: every rank scans
its folder (files whose checksum verifies), the ranks exchange what they hold, and the newest
iteration that some rank committed (its tracker names it or a later one) and whose every
rank's state is held by some rank wins, if it is at least as new as the persistent checkpoint
(Megatron's rule); a rank whose own copy is gone gets it from the holder of a replica.
"""
from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from app.checkpoint import CheckpointError, commit, model_args, names
from app.checkpoint.snapshot import HostBuffers, host_copy
from app.checkpoint.files import allowed_globals, sha256_file, sidecar_path, read_checksums
from app.config.checkpoint import CheckpointConfig
from app.launch.distributed import all_ranks_ok, world_group
from app.mpu import collectives
from app.mpu.random import load_rng_state_dict, rng_state_dict
from app.training.checkpointing.resume import LoadResult, check_finite_weights
from app.utils.fileio import remove_temporaries

logger = logging.getLogger(__name__)

LOCAL_FORMAT_VERSION = 1
"""Version of a local state file's content (its `version` entry)."""


def rank_dir(local_dir: str, rank: int) -> str:
    """The folder rank `rank` writes its local checkpoints in."""
    return os.path.join(local_dir, f"rank_{rank}")


def state_file(directory: str, owner: int) -> str:
    """The file of rank `owner`'s state in an iteration directory."""
    return os.path.join(directory, f"state_rank_{owner:05d}.pt")


def replica_group(rank: int, world_size: int, jump: int, factor: int) -> List[int]:
    """The ranks holding `rank`'s local checkpoint, itself first: Megatron's clique
    replication, the `factor` ranks `jump` apart in `rank`'s block of jump x factor ranks
    (rank n with its replicas on n + J, n + 2J, ... or n - J, ...)."""
    block = jump * factor
    if world_size % block:
        raise ValueError(f"world size ({world_size}) is not divisible by --replication-jump "
                         f"({jump}) x --replication-factor ({factor})")
    base = rank - rank % block + rank % jump
    return [rank] + [base + i * jump for i in range(factor) if base + i * jump != rank]


def group_of(cfg: CheckpointConfig, rank: int, world_size: int) -> List[int]:
    """`replica_group` of the flags, or just `rank` without --replication."""
    if not cfg.replication:
        return [rank]
    return replica_group(rank, world_size, cfg.replication_jump, cfg.replication_factor)


# ---------------------------------------------------------------------------- bytes on the wire

def _to_tensor(data: bytes, device: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)  # [n]


def exchange(sends: Dict[int, bytes], recv_from: List[int], device: Any,
             group: Any = None) -> Dict[int, bytes]:
    """Send `sends[peer]` to each peer and receive one message from each rank of `recv_from`
    (point to point over `group`, default the world, by global ranks: lengths first, then the
    bytes); {source: bytes}."""
    group = world_group() if group is None else group
    lengths = {src: torch.zeros(1, dtype=torch.int64, device=device) for src in recv_from}
    collectives.send_recv(
        [(torch.tensor([len(d)], dtype=torch.int64, device=device), p) for p, d in sends.items()],
        [(t, src) for src, t in lengths.items()], group)
    buffers = {src: torch.empty(int(t.item()), dtype=torch.uint8, device=device)
               for src, t in lengths.items()}
    collectives.send_recv([(_to_tensor(d, device), p) for p, d in sends.items()],
                          [(b, src) for src, b in buffers.items()], group)
    return {src: b.cpu().numpy().tobytes() for src, b in buffers.items()}


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _deserialize(data: bytes, where: str, safe_globals: List[Any]) -> Dict[str, Any]:
    """A local state file's content, unpickled with weights_only and the allow-list."""
    try:
        with torch.serialization.safe_globals(allowed_globals() + list(safe_globals)):
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged or unsafe file, named
        raise CheckpointError(f"local checkpoint {where} cannot be read: "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    if not isinstance(state, dict) or state.get("version") != LOCAL_FORMAT_VERSION:
        raise CheckpointError(f"{where} is not a local checkpoint of version "
                              f"{LOCAL_FORMAT_VERSION}; remove --non-persistent-local-ckpt-dir's "
                              "files to start from the persistent checkpoint")
    return state


# ---------------------------------------------------------------------------- saving

class LocalCheckpoints(commit.OneSaveAtATime):
    """This rank's local checkpoints: `save_checkpoint(save_dir, ...)` with `save_dir` its own
    folder (`rank_dir`), as an engine's (so `CheckpointSaver` drives it)."""

    def __init__(self, cfg: CheckpointConfig, engine: Any, rank: int, world_size: int,
                 device: Any) -> None:
        self.engine, self.rank, self.world_size, self.device = engine, rank, world_size, device
        self.group = group_of(cfg, rank, world_size)
        self.folder = rank_dir(cfg.non_persistent_local_ckpt_dir, rank)
        os.makedirs(self.folder, exist_ok=True)
        remove_temporaries(self.folder)  # a dead writer's (a killed run's) half-written files
        self._buffers = HostBuffers()  # the host copy of one save, reused by the next
        self._replica_group = None
        if cfg.replication:  # the writer thread's own group (gloo, host bytes) per clique
            cliques = sorted({tuple(sorted(group_of(cfg, r, world_size)))
                              for r in range(world_size)})
            groups = collectives.host_groups(cliques)
            self._replica_group = next(g for c, g in zip(cliques, groups) if rank in c)

    def record(self, iteration: int, client_state: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's whole state of `iteration`, live (training thread; all ranks call)."""
        return {"version": LOCAL_FORMAT_VERSION, "iteration": iteration, "owner": self.rank,
                "world_size": self.world_size, "state": self.engine.local_state(), "rng_state": rng_state_dict(),
                "client_state": dict(client_state)}

    def start_save(self, save_dir: str, iteration: int, client_state: Any,
                   asynchronous: bool) -> commit.PendingSave:
        """Copy this rank's state to host memory now; then (in the background with
        `asynchronous`) serialize it, with --replication exchange it with the replica group
        over the writer's own group, and write the files (its own and the replicas it holds);
        committed by finish_save."""
        self._buffers.new_save()  # the previous save is committed (one at a time)
        copied = host_copy(self.record(iteration, client_state), self._buffers)
        peers = self.group[1:]
        directory = names.checkpoint_dir(save_dir, iteration)
        written: List[str] = []

        def writers() -> Dict[int, Callable[[Any], Any]]:  # owner -> write(file) of its state
            if not peers:
                return {self.rank: lambda f: torch.save(copied, f)}
            mine = _serialize(copied)
            held = {self.rank: mine, **exchange({p: mine for p in peers}, peers,
                                                torch.device("cpu"), self._replica_group)}
            return {owner: (lambda f, d=data: f.write(d)) for owner, data in held.items()}

        def write() -> None:
            for owner, write_to in sorted(writers().items()):
                path = state_file(directory, owner)
                commit.write_checked_file(path, write_to)
                written.append(path)

        def undo() -> None:
            for path in written:
                commit.remove_written_file(path, directory)

        return commit.start_save(save_dir, iteration, write=write, undo=undo,
                                 agree=commit.world_agreement(self.device),
                                 is_tracker_writer=True, keep_last_n=1, background=asynchronous)


# ---------------------------------------------------------------------------- resuming

def scan(folder: str) -> Dict[str, Any]:
    """What a rank's folder holds: its tracker's iteration (None when none) and, by iteration,
    the owners whose state file is present and matches its checksum."""
    tracker = names.read_tracker(folder) if os.path.isdir(folder) else None
    held: Dict[int, List[int]] = {}
    for iteration in (names.list_checkpoint_iterations(folder) if os.path.isdir(folder) else []):
        directory = names.checkpoint_dir(folder, iteration)
        for name in sorted(os.listdir(directory)):
            if not (name.startswith("state_rank_") and name.endswith(".pt")):
                continue
            path = os.path.join(directory, name)
            digests = read_checksums(sidecar_path(path))
            if digests and sha256_file(path) in digests:
                held.setdefault(iteration, []).append(int(name[len("state_rank_"):-3]))
    return {"tracker": tracker if isinstance(tracker, int) else None, "held": held}


def newest_complete(scans: List[Dict[str, Any]], at_most: Optional[int] = None
                    ) -> Tuple[Optional[int], Dict[int, int], str]:
    """(iteration, {owner: holder rank}, why) of the newest iteration, up to `at_most` when
    given, that some rank committed and whose every rank's state some rank holds (a rank's own
    copy preferred); (None, {}, why not) when there is none. `scans[r]` is rank r's `scan`."""
    world = len(scans)
    committed = max((s["tracker"] for s in scans if s["tracker"] is not None), default=None)
    if committed is None:
        return None, {}, "no rank has committed a local checkpoint"
    if at_most is not None and committed > at_most:
        committed = at_most
        why = f"no iteration up to {at_most} (the run's position) is held for every rank"
    else:
        why = f"no iteration up to {committed} (the newest committed) is held for every rank"
    iterations = sorted({i for s in scans for i in s["held"] if i <= committed}, reverse=True)
    for iteration in iterations:
        holders: Dict[int, int] = {}
        for owner in range(world):
            have = [r for r in range(world) if owner in scans[r]["held"].get(iteration, [])]
            if have:
                holders[owner] = owner if owner in have else have[0]
        if len(holders) == world:
            return iteration, holders, ""
        missing = sorted(set(range(world)) - set(holders))
        why = f"iteration {iteration} lacks the state of rank(s) {missing}"
    return None, {}, why


def _my_payload(folder_of: Callable[[int], str], iteration: int, holders: Dict[int, int],
                rank: int, device: Any) -> Tuple[bytes, str]:
    """This rank's state file of `iteration`: read from its folder, or sent by the rank
    holding its replica (every holder of another rank's state sends it; all ranks call)."""
    def read(owner: int) -> bytes:
        path = state_file(names.checkpoint_dir(folder_of(rank), iteration), owner)
        with open(path, "rb") as f:
            return f.read()
    sends = {owner: read(owner) for owner, holder in holders.items()
             if holder == rank and owner != rank}
    source = holders[rank]
    received = exchange(sends, [] if source == rank else [source], device)
    where = state_file(names.checkpoint_dir(folder_of(source), iteration), rank)
    return (read(rank) if source == rank else received[source]), where


@dataclass(frozen=True)
class LocalPick:
    """The local checkpoint a load takes: its iteration and, by owner rank, the rank that holds
    the owner's state (`newest_complete`)."""

    iteration: int
    holders: Dict[int, int]


def pick_newest(cfg: CheckpointConfig, persistent_iteration: Optional[int],
                persistent_dir: str, at_most: Optional[int]) -> Optional[LocalPick]:
    """The newest local checkpoint complete over all ranks (up to `at_most`) if it is at
    least as new as `persistent_iteration` (Megatron's rule), else None (and why is logged).
    Every rank calls it and all decide alike (one gather of what each rank's folder holds)."""
    rank = collectives.group_rank(world_group())
    local_dir = cfg.non_persistent_local_ckpt_dir
    scans = collectives.broadcast_object(
        collectives.gather_object(scan(rank_dir(local_dir, rank)), 0, world_group()), 0,
        world_group())
    iteration, holders, why = newest_complete(scans, at_most)
    if iteration is None or (persistent_iteration is not None and iteration < persistent_iteration):
        reason = why or f"its newest complete iteration {iteration} is older"
        logger.info("local checkpoints in %s not used (%s): %s", local_dir, reason,
                    f"loading {persistent_words(persistent_iteration, persistent_dir)}"
                    if persistent_iteration is not None else
                    "and there is no persistent checkpoint")
        return None
    return LocalPick(iteration, holders)


def persistent_words(iteration: Optional[names.Iteration], directory: Optional[str]) -> str:
    """'the persistent checkpoint of iteration N in DIR', or 'no persistent checkpoint'."""
    return (f"the persistent checkpoint of iteration {iteration} in {directory}"
            if iteration is not None else "no persistent checkpoint")


def load_pick(engine: Any, cfg: CheckpointConfig, device: Any, pick: LocalPick,
              instead_of: str = "", doing: str = "resuming from") -> LoadResult:
    """Load the local checkpoint `pick` into `engine` (and the RNG states unless
    --no-load-rng) on every rank, a rank whose own copy is lost taking it from a replica's
    holder; its position. Logs `doing` the checkpoint, `instead_of` what (for the log)."""
    world, rank = collectives.group_size(world_group()), collectives.group_rank(world_group())
    local_dir, iteration, holders = cfg.non_persistent_local_ckpt_dir, pick.iteration, pick.holders
    replicas = sorted(o for o, h in holders.items() if o != h)
    data, where = _my_payload(lambda r: rank_dir(local_dir, r), iteration, holders, rank, device)
    error: Optional[BaseException] = None
    try:
        state = _deserialize(data, where, engine.local_safe_globals())
        if state["world_size"] != world:
            raise CheckpointError(
                f"local checkpoint {where} was saved by {state['world_size']} ranks and this run "
                f"has {world}: local checkpoints resume the same layout only; run with "
                f"{state['world_size']} ranks, or remove {local_dir} to resume from the "
                "persistent checkpoint")
        engine.load_local_state(state["state"], where)
        if not cfg.no_load_rng:
            load_rng_state_dict(state["rng_state"])
        check_finite_weights(engine.local_parameters(), where)
    except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
        error = exc
    if not all_ranks_ok(error is None, device):
        raise error or CheckpointError(
            f"another rank could not load the local checkpoint of iteration {iteration} in "
            f"{local_dir}; its message says why")
    logger.info("%s the local checkpoint of iteration %d in %s (the newest complete over all %d "
                "ranks%s)%s", doing, iteration, local_dir, world,
                f"; rank(s) {replicas} restored from replicas" if replicas else "",
                f", not from {instead_of}" if instead_of else "")
    position = state["client_state"]
    return LoadResult(iteration, int(position.get("consumed_train_samples", 0)),
                      int(position.get("consumed_valid_samples", 0)),
                      names.checkpoint_dir(rank_dir(local_dir, rank), iteration),
                      position.get("data_order"),
                      model_args.checkpoint_writer(None, position.get("writer")))


__all__ = ["LocalCheckpoints", "LocalPick", "load_pick", "newest_complete", "pick_newest",
           "replica_group", "scan"]
