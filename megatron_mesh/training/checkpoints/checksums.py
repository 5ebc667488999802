"""Checksums of a checkpoint's files: written with the checkpoint, verified before loading.

    SAVE/iter_0000040/checksums.json   {"algorithm": "crc32", "files": {name: [bytes, crc32]}}

Every rank hashes a share of the files (file i on rank i % world), so the cost is split over
the job, then rank 0 writes the manifest into the temporary folder before the rename that
makes the checkpoint complete. Loading verifies the same way and every rank gets the whole
verdict, so a corrupted file stops all ranks with the same message before any rank reads a
tensor. crc32 (zlib) is the cheapest of the standard library's hashes by far; it catches
any burst error up to 32 bits and random corruption with probability 1 - 2^-32.
"""
from __future__ import annotations

import json
import os
import zlib

import torch.distributed as dist

MANIFEST = "checksums.json"
ALGORITHM = "crc32"
_BLOCK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message says what to do instead."""


def file_checksum(path: str) -> tuple[int, int]:
    """(size in bytes, crc32) of one file, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def _files(folder: str) -> list[str]:
    """Every file under folder (relative paths, sorted), the manifest excluded."""
    names = []
    for parent, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(parent, name), folder)
            if rel != MANIFEST:
                names.append(rel)
    return sorted(names)


def _shared(names: list[str], folder: str) -> dict[str, list[int]]:
    """Checksums of names, each computed on one rank and gathered on all."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {}
    for name in names[rank::world]:
        try:
            mine[name] = list(file_checksum(os.path.join(folder, name)))
        except OSError as e:
            mine[name] = [-1, str(e)]
    if world == 1:
        return mine
    every: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def write_manifest(folder: str) -> None:
    """Hash every file under folder (collective) and write the manifest there (rank 0)."""
    sums = _shared(_files(folder), folder)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = os.path.join(folder, MANIFEST)
        with open(path, "w") as f:
            json.dump({"algorithm": ALGORITHM, "files": sums}, f, indent=0, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())


def _listed(folder: str, older: str) -> dict[str, list] | None:
    """The manifest's {file: [bytes, crc32]} (None without a manifest)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            listed = json.load(f)["files"]
        if not isinstance(listed, dict):
            raise TypeError(f"'files' is a {type(listed).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable ({e}); {older}")
    return listed


def _compare(folder: str, listed: dict[str, list], actual: dict[str, list], older: str) -> None:
    """CheckpointError naming the first file whose size or checksum is not the manifest's."""
    for name in sorted(actual):
        size, crc = listed[name]
        got_size, got = actual[name]
        if got_size == -1:
            problem = f"cannot be read ({got})"
        elif got_size != size:
            problem = f"has {got_size} bytes, {size} were written"
        elif got != crc:
            problem = f"is corrupted ({ALGORITHM} {got:08x}, {crc:08x} was written)"
        else:
            continue
        raise CheckpointError(f"checkpoint {folder}: file {name} {problem}; {older}")


def verify_manifest(folder: str, older: str) -> bool:
    """Check every file listed in folder's manifest (collective); False without a manifest.

    Raises CheckpointError naming the checkpoint, the file and ``older`` (what to load
    instead) on a missing file, a size or a checksum that differs.
    """
    listed = _listed(folder, older)
    if listed is None:
        return False
    _compare(folder, listed, _shared(sorted(listed), folder), older)
    return True


def verify_files(folder: str, names: tuple[str, ...], older: str) -> bool:
    """`verify_manifest` for the manifest's files among `names` alone, on this rank (no
    collective): the small files read before the load (common.pt, metadata). False without a
    manifest."""
    listed = _listed(folder, older)
    if listed is None:
        return False
    actual = {}
    for name in sorted(set(names) & set(listed)):
        try:
            actual[name] = list(file_checksum(os.path.join(folder, name)))
        except OSError as e:
            actual[name] = [-1, str(e)]
    _compare(folder, listed, actual, older)
    return True
