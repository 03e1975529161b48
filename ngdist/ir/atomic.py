"""Atomic file writes: a temporary file beside the target, then a rename over it.

A write killed at any point leaves the target as it was (or absent). The temporary files of
writes killed on this host are removed by the next write of the same target, once their
process no longer runs; those of other hosts sharing the folder are left alone.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import socket
import stat
from pathlib import Path

logger = logging.getLogger(__name__)


_TMP_MARK = ".ngdist-tmp-"  # .<name>.ngdist-tmp-<pid>-<host>-<random>: a save in progress


def _tmp_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(f".{name}{_TMP_MARK}") + r"(\d+)-(.*)-[0-9a-f]{8}")


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _host() -> str:
    """This host's name as temporary file names carry it."""
    return socket.gethostname().split(".")[0].replace("/", "_")[:32] or "localhost"


def _remove_stale_temps(path: Path, host: str) -> None:
    """Delete the temporary files that saves of ``path`` killed on this host left behind
    (their process no longer runs); those of other hosts sharing the folder are left alone."""
    pattern = _tmp_pattern(path.name)
    try:
        entries = os.listdir(path.parent)
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match and match.group(2) == host and not _process_runs(int(match.group(1))):
            try:
                (path.parent / entry).unlink()
                logger.info("removed %s, left behind by an interrupted save", path.parent / entry)
            except OSError:  # removed meanwhile, or not ours to remove
                pass


def remove_stale_temps_in(folder: str | os.PathLike) -> None:
    """:func:`_remove_stale_temps` for every target in ``folder`` that has a temporary file
    (saves killed on this host whose target was never saved again)."""
    folder = Path(folder)
    host = _host()
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for target in {e[1:e.index(_TMP_MARK)] for e in entries
                   if e.startswith(".") and _TMP_MARK in e}:
        _remove_stale_temps(folder / target, host)




def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` atomically: a temporary file in the same folder, then rename over it.

    A save killed at any point leaves the target as it was (or absent); the temporary file it
    leaves (``.<name>.ngdist-tmp-<pid>-<host>-<random>``) is removed by the next save of the
    same target once that process no longer runs. The file gets the permissions ``open()``
    gives: those of the file it replaces, else 0o666 less the umask. An OSError names ``path``.
    """
    path = Path(path)
    host = _host()
    tmp = path.parent / f".{path.name}{_TMP_MARK}{os.getpid()}-{host}-{secrets.token_hex(4)}"
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where the folder should be
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None
        _remove_stale_temps(path, host)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode) if path.is_file() else None
        except OSError:
            mode = None
        # created like open() creates a file: 0o666, less the umask (applied by the system)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as fh:
                if mode is not None:
                    os.fchmod(fh.fileno(), mode)
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        if exc.errno is None or exc.filename == str(path):
            raise
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
    try:  # the rename itself survives a crash of the machine
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    logger.info("wrote %s (%d bytes)", path, path.stat().st_size)
