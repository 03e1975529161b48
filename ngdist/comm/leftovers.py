"""Shared-memory files that a failed job leaves in ``/dev/shm``, found and removed.

MPICH's ranks on one host share memory through files in ``/dev/shm`` (``mpich_shm_*``) that
MPI_Finalize removes. A rank killed by a signal, or a job that ends in MPI_Abort, never gets
there, and neither do its peers that the launcher stops: each such job leaves its segments
behind (2-3 MB for a job of 2 ranks). ``/dev/shm`` is a tmpfs, so they hold memory until the
machine reboots: a day of test runs that kill ranks on purpose left 752 of them (1.7 GB) on
one machine. ngdist's own symmetric memory (comm/shared.py, ``ngdist-*``) is unlinked as soon
as every rank has mapped it, but a rank killed within that window leaves its file too.

The launcher (comm/supervisor.py) takes a :func:`snapshot` of the directory before it starts a
job and calls :func:`remove` when the job has ended. A file counts as left over when it
appeared while the job ran, belongs to this user, and no live process maps it
(``/proc/PID/maps``) in two looks ``SETTLE_S`` apart: a segment of another job that is still
running is always mapped by one of its ranks (its creator maps it right after making it; the
second look covers that moment). Only this host is looked at.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIXES = ("mpich_shm_", "ngdist-")
SETTLE_S = 0.2


def snapshot(directory: str = SHM_DIR) -> frozenset[str]:
    """The names of the shared-memory files in ``directory`` now."""
    try:
        return frozenset(n for n in os.listdir(directory) if n.startswith(PREFIXES))
    except OSError:
        return frozenset()


def mapped_paths(pids: Iterable[str] | None = None) -> set[str]:
    """The paths of files that live processes map (those whose maps this user can read)."""
    paths: set[str] = set()
    if pids is None:
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return paths
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    fields = line.split(None, 5)
                    if len(fields) == 6:
                        paths.add(fields[5].rstrip("\n"))
        except OSError:  # the process ended, or belongs to another user
            continue
    return paths


def find(before: frozenset[str], directory: str = SHM_DIR,
         settle_s: float = SETTLE_S) -> list[str]:
    """The paths of files in ``directory`` left over by a job that started after ``before``
    was taken (see the module docstring)."""
    uid = os.getuid()
    candidates = []
    for name in sorted(snapshot(directory) - before):
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid == uid:
                candidates.append(path)
        except OSError:
            continue
    for look in range(2):
        if not candidates:
            break
        if look:
            time.sleep(settle_s)
        mapped = mapped_paths()
        candidates = [p for p in candidates if p not in mapped]
    return candidates


def remove(before: frozenset[str], directory: str = SHM_DIR,
           settle_s: float = SETTLE_S) -> int:
    """Remove what :func:`find` finds; the number of files removed."""
    removed = 0
    for path in find(before, directory, settle_s):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not remove %s, which a failed job left: %s", path, exc)
    if removed:
        logger.info("removed %d shared-memory file(s) that the job left in %s", removed,
                    directory)
    return removed
