"""Checksums of a checkpoint's files: written at save time, verified before a load reads anything.

A file whose size is right can still hold other bytes (a flipped bit on a disk or in a copy, a shard from another
step of the same run); loading it silently trains on from wrong weights. So every file gets a checksum, recorded in
``ultrascale.json`` under ``"checksums"`` with the algorithm's name.

**Who hashes what at save time.** Each rank hashes the files it wrote, right after writing them (from the page
cache): its DCP shards (``HashingWriter``, in the thread that writes them, the background thread of an asynchronous
save), its rank-local file, and rank 0 the shared files it writes (DCP's ``.metadata``, the caller's files, the
tokenizer). Rank 0 gathers the digests (a few dozen bytes per file) into ``ultrascale.json`` and hashes only what no
rank claimed: a front end's own small files, written by ``before_commit`` (Trainer's state, scheduler, RNG).

**Who verifies what at load.** Verifying re-reads every byte, so no file is read twice for it: each rank verifies a
disjoint share (``share``), and the ranks agree before anything is loaded (``agree``: one all-reduce, and on a
failure one broadcast of the message, so every rank refuses with the same line and none waits in the load). A rank's
shards and rank-local file are verified by the rank of the same number (modulo the world size): in the same layout
the files it reads most of, which the load then finds in the page cache. The shared files go round the ranks.
The command line's check before launch verifies the shared files only (small; ``shared``); the shards and the
rank-local files, one per rank, are left to the workers, which verify them in parallel. ``ultrascale export`` runs
in one process and verifies every file.

CRC-32 (``zlib.crc32``): it costs half the CPU time of SHA-256 per byte on a CPU with SHA extensions (0.31 s against
0.65 s per GiB, benchmarks/README.md section 18), and it is what accidental corruption calls for: every change of up
to 32 consecutive bits is caught, any other with probability 1 - 2^-32. A cryptographic hash would add no
protection against a deliberate change, since whoever can rewrite a shard can rewrite ``ultrascale.json`` too (the
restricted unpickler, ``sharded.SafeReader``, is what keeps a forged checkpoint from running code).
``ULTRASCALE_SKIP_CHECKSUMS=1`` skips the verification (sizes are still checked; checksums are still written), with
a note.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .errors import CheckpointError

ALGORITHM = "crc32"
CHUNK_BYTES = 4 * 2**20
SKIP_ENV = "ULTRASCALE_SKIP_CHECKSUMS"
SHARD_SUFFIX = ".distcp"
RANK_LOCAL = "rank_local/"


def file_digest(path: str | Path) -> str:
    """The CRC-32 of a file as 8 hex digits, read in chunks into one buffer (zlib releases the GIL while it sums a
    chunk, so an asynchronous save's background thread does not hold up training)."""
    value = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            value = zlib.crc32(view[:n], value)
    return f"{value:08x}"


class HashingWriter(dcp.FileSystemWriter):
    """DCP's file system writer that hashes each file it wrote once it is written, in the thread that wrote it;
    ``digests``: name (relative to the checkpoint) -> checksum, this rank's shards (and, on the coordinator,
    ``.metadata``)."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self.digests: dict[str, str] = {}

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        for name in sorted({r.storage_data.relative_path for r in written.wait()}):
            self.digests[name] = file_digest(Path(self.path) / name)
        return written

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.digests[".metadata"] = file_digest(Path(self.path) / ".metadata")


def digests_of(directory: Path, paths) -> dict[str, str]:
    """name (relative to ``directory``) -> checksum of every file at or under ``paths``."""
    out = {}
    for p in paths:
        for f in ([p] if p.is_file() else sorted(p.rglob("*"))):
            if f.is_file():
                out[str(f.relative_to(directory))] = file_digest(f)
    return out


def gather_digests(own: dict[str, str]) -> dict[str, str] | None:
    """Every rank's ``own`` digests, merged on rank 0 (None elsewhere): collective."""
    if dist.get_world_size() == 1:
        return dict(own)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own, parts, dst=0)
    if parts is None:
        return None
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    return merged


def record(directory: Path, claimed: dict[str, str], names) -> dict:
    """``ultrascale.json``'s ``"checksums"``: the digests the ranks gathered (``claimed``) for ``names`` (every file
    of the checkpoint), rank 0 hashing the files no rank claimed."""
    files = {n: claimed[n] if n in claimed else file_digest(directory / n) for n in names}
    return {"algorithm": ALGORITHM, "files": files}


def recorded(path: Path, meta: dict) -> dict[str, str] | None:
    """name -> digest as the checkpoint records it; None for a checkpoint written before checksums."""
    entry = meta.get("checksums")
    if entry is None:
        return None
    if entry.get("algorithm") != ALGORITHM:
        raise CheckpointError(f"checkpoint '{path}': its files' checksums are {entry.get('algorithm')!r}, which "
                              f"this version does not compute ({ALGORITHM}). Fix: load it with the version of "
                              f"ultrascale-plugins that wrote it, or set {SKIP_ENV}=1 to load it unverified")
    return entry["files"]


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


def problem_with(path: Path, meta: dict, name: str, digests: dict[str, str] | None) -> str | None:
    """What is wrong with the checkpoint's file ``name`` (missing, another size, other contents), as one line
    ending in a fix; None when it is as written. ``digests``: None to check the size only."""
    f = path / name
    size = meta.get("files", {}).get(name)
    if not f.is_file():
        return f"checkpoint '{path}': file '{name}' is missing. Fix: restore it, or use another checkpoint"
    if size is not None and f.stat().st_size != size:
        return (f"checkpoint '{path}': file '{name}' is truncated or corrupted ({f.stat().st_size} bytes, {size} "
                "written). Fix: restore it, or use another checkpoint")
    if digests is not None and name in digests and file_digest(f) != digests[name]:
        return (f"checkpoint '{path}': file '{name}' is corrupted (same size, but its {ALGORITHM} is not the one "
                "written at save time). Fix: restore it from a copy, or use another checkpoint")
    return None


def _writer_rank(name: str) -> int | None:
    """The rank that wrote a per-rank file (DCP's ``__<rank>_<n>.distcp``, ``rank_local/rank<rank>.pt``)."""
    try:
        if name.startswith("__") and name.endswith(SHARD_SUFFIX):
            return int(name[2:].split("_", 1)[0])
        if name.startswith(RANK_LOCAL):
            return int(Path(name).stem.removeprefix("rank"))
    except ValueError:
        return None
    return None


def shared(names) -> list[str]:
    """The files no single rank wrote for itself (``.metadata``, a front end's and the caller's files, the
    tokenizer): small, whatever the world size."""
    return sorted(n for n in names if _writer_rank(n) is None)


def share(names, rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` verifies: every file falls to exactly one rank. A per-rank file goes to
    the rank of its writer's number (modulo ``world``), the shared files round the ranks."""
    mine = [n for n in sorted(names) if (w := _writer_rank(n)) is not None and w % world == rank]
    return mine + [n for i, n in enumerate(shared(names)) if i % world == rank]


def verify(path: Path, meta: dict, names) -> str | None:
    """The first problem with ``names`` (sizes, and contents unless skipped or not recorded); None if none."""
    digests = None if skipped() else recorded(path, meta)
    for name in names:
        problem = problem_with(path, meta, name, digests)
        if problem:
            return problem
    return None


def check(path: Path, meta: dict, names) -> None:
    """Refuse the checkpoint, naming the file, when one of ``names`` is not as written (in one process: export
    and the command line's check before launch)."""
    problem = verify(path, meta, names)
    if problem:
        raise CheckpointError(problem)


def agree(problem: str | None, device: torch.device) -> str | None:
    """The lowest failing rank's problem, on every rank (None when every rank found none): collective, one
    all-reduce and, on a failure, one broadcast."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problem
    from ..distributed.launch import broadcast_object

    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if problem else world], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    source = int(first.item())
    return None if source == world else broadcast_object(problem, source)


def unverified_note(path: Path, meta: dict) -> str | None:
    """The line to say when a load does not verify contents (None when it does)."""
    if skipped():
        return (f"ultrascale: checkpoint '{path}': file contents not verified ({SKIP_ENV}=1); sizes checked, "
                "checksums still written")
    if meta.get("checksums") is None:
        return (f"ultrascale: checkpoint '{path}' was written before checkpoints carried checksums: its files' sizes "
                "are checked, not their contents (a save with this version adds them)")
    return None


def say_once(line: str | None) -> None:
    """``line`` from global rank 0 only."""
    if line and (not dist.is_initialized() or dist.get_rank() == 0):
        print(line, flush=True)

