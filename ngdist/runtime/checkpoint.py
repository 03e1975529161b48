"""Periodic checkpoints of a Trainer and resuming from the newest complete one.

A checkpoint folder holds ``step-<8 digits>.npz`` files and ``manifest.json``:

- A checkpoint is one ``.npz``: every value the step updates or reads (parameters, buffers,
  optimizer state, the step counter ``ngdist.step``, the learning rate) as ``a0``, ``a1``, ...
  plus ``meta``, a JSON string: the value names with their dtype and shape, ``steps_done``,
  the number of training ranks and the micro-batch size of reproducible mode. The data order is
  a function of the step (the trainer's ``resumed_from``): a loop that draws its batches from
  the step index (a seeded shuffle per epoch, as ``ngdist train``) continues with the batch it
  would have trained next.
- Each file is written with ``write_atomic`` (temporary file, fsync, rename), then the manifest
  (also atomically) lists it with its size and SHA-256, newest last. Only a file the manifest
  lists, with that size and digest, is resumed from: a write killed before the rename leaves a
  temporary file nobody reads, one killed between the two renames a file the manifest does not
  name; both are removed when the next job resumes from the folder.
- The manifest keeps the newest ``keep`` checkpoints (3 by default); older files are deleted
  after the manifest that drops them is in place.
- Rank 0 alone writes and reads them, so only a strategy under which every rank holds the same
  state can checkpoint (``check_checkpointable``); at start-up ``resume`` loads the newest one
  on rank 0 and tells every rank its step count (or the same error).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ngdist.comm import ProcessGroup
from ngdist.errors import CheckpointError
from ngdist.ir.domain import DOMAIN, GRAD_SCALE
from ngdist.ir.atomic import remove_stale_temps_in, write_atomic

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
DEFAULT_KEEP = 3
_NAME = re.compile(r"step-(\d{8,})\.npz")


@dataclass
class Checkpoint:
    path: Path
    steps_done: int
    values: dict[str, np.ndarray]
    ranks: int
    micro_batch: int


def file_name(steps_done: int) -> str:
    return f"step-{steps_done:08d}.npz"


def encode(values: Mapping[str, np.ndarray], steps_done: int, ranks: int,
           micro_batch: int) -> bytes:
    """The bytes of one checkpoint file (see the module docstring)."""
    names = sorted(values)
    meta = {"format": FORMAT, "steps_done": steps_done, "ranks": ranks,
            "micro_batch": micro_batch,
            "values": [[n, str(values[n].dtype), list(values[n].shape)] for n in names]}
    buf = io.BytesIO()
    np.savez(buf, meta=np.array(json.dumps(meta)),
             **{f"a{i}": np.ascontiguousarray(values[n]) for i, n in enumerate(names)})
    return buf.getvalue()


def read_manifest(folder: Path) -> list[dict]:
    """The manifest's entries, oldest first ([] when there is none)."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint manifest ({exc}); remove the "
                              "folder's files to start afresh") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or \
            not isinstance(data.get("checkpoints"), list):
        raise CheckpointError(f"{path} is not an ngdist checkpoint manifest (format {FORMAT}); "
                              "give checkpoint_dir a folder of its own")
    return data["checkpoints"]


def write(folder: str | os.PathLike, values: Mapping[str, np.ndarray], steps_done: int, *,
          ranks: int, micro_batch: int, keep: int = DEFAULT_KEEP) -> Path:
    """Write one checkpoint and list it in the manifest; keep the newest ``keep``."""
    folder = Path(folder)
    data = encode(values, steps_done, ranks, micro_batch)
    name = file_name(steps_done)
    write_atomic(folder / name, data)
    entries = [e for e in read_manifest(folder) if e.get("file") != name]
    entries.append({"file": name, "steps_done": steps_done, "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest()})
    entries = entries[-keep:]
    write_atomic(folder / MANIFEST, json.dumps({"format": FORMAT, "checkpoints": entries},
                                               indent=1).encode())
    _remove_unlisted(folder, {e["file"] for e in entries})
    logger.info("checkpoint of step %d: %s", steps_done, folder / name)
    return folder / name


def _remove_unlisted(folder: Path, listed: set[str]) -> None:
    """Checkpoint files the manifest does not list (older ones, or a write killed before
    the manifest named it)."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        if _NAME.fullmatch(entry) and entry not in listed:
            try:
                (folder / entry).unlink()
            except OSError:
                pass


def latest(folder: str | os.PathLike) -> Checkpoint | None:
    """The newest complete checkpoint the manifest lists (size and SHA-256 checked); None
    when there is none. A listed file that does not check out is skipped with a warning."""
    folder = Path(folder)
    for entry in reversed(read_manifest(folder)):
        path = folder / str(entry.get("file"))
        try:
            data = path.read_bytes()
        except OSError as exc:
            logger.warning("checkpoint %s is listed but unreadable (%s); trying an older one",
                           path, exc.strerror or exc)
            continue
        if len(data) != entry.get("bytes") or \
                hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            logger.warning("checkpoint %s does not match its manifest entry (size or SHA-256); "
                           "trying an older one", path)
            continue
        return decode(path, data)
    return None


def decode(path: Path, data: bytes) -> Checkpoint:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
            values = {n: npz[f"a{i}"] for i, (n, _, _) in enumerate(meta["values"])}
        return Checkpoint(path, int(meta["steps_done"]), values, int(meta["ranks"]),
                          int(meta["micro_batch"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a readable ngdist checkpoint ({exc})") from None


def check_model(ckpt: Checkpoint, expected: Mapping[str, np.ndarray]) -> None:
    """The checkpoint holds exactly ``expected``'s names with their dtypes and shapes (a
    one-element value in any shape), else a CheckpointError listing the differences."""
    problems = []
    for name in sorted(expected.keys() - ckpt.values.keys()):
        problems.append(f"'{name}' is missing")
    for name in sorted(ckpt.values.keys() - expected.keys()):
        problems.append(f"'{name}' is not in this model")
    for name in sorted(expected.keys() & ckpt.values.keys()):
        have, want = ckpt.values[name], expected[name]
        # a scalar may come back from the step as [1]: one element is one element
        same_shape = have.shape == want.shape or have.size == want.size == 1
        if not same_shape or have.dtype != want.dtype:
            problems.append(f"'{name}' is {have.dtype}{list(have.shape)} there, "
                            f"{want.dtype}{list(want.shape)} here")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                            if len(problems) > 5 else "")
        raise CheckpointError(
            f"checkpoint {ckpt.path} belongs to another model: {shown}. Give this model a "
            "checkpoint folder of its own (checkpoint_dir= or NGDIST_CHECKPOINT_DIR), or empty "
            "that one to start afresh")


def clean(folder: str | os.PathLike) -> None:
    """What killed writes left in ``folder``: temporary files of dead processes on this host
    and checkpoint files the manifest does not list. Call it only when no job writes there."""
    folder = Path(folder)
    remove_stale_temps_in(folder)
    if (folder / MANIFEST).exists():
        _remove_unlisted(folder, {str(e.get("file")) for e in read_manifest(folder)})


def check_checkpointable(graph: onnx.GraphProto, ranks: int) -> None:
    """Checkpoints are written by rank 0 alone: only where every rank holds the same
    state (allreduce, simple; any strategy on one rank)."""
    comm = {n.op_type for n in graph.node if n.domain == DOMAIN}
    why = None
    if "PushSum" in comm:
        why = "under pushsum every rank holds its own parameters and push-sum weights"
    elif "PSPushPull" in comm:
        why = "under ps the optimizer state lives with the shard owners"
    elif not comm and ranks > 1:
        why = "without communication (strategy local) every rank trains its own model"
    if why:
        raise CheckpointError(
            f"checkpoint_dir: {why}, and a checkpoint holds one copy of the state written "
            "by rank 0; use the allreduce or simple strategy, or save per rank yourself "
            "(trainer.save(path, all_ranks=True); under ps trainer.sync_state() first)")


def resume(folder: Path, host: dict[str, np.ndarray], group: ProcessGroup,
           micro_batch: int) -> int:
    """Collective: rank 0 loads the newest complete checkpoint of ``folder`` into ``host``
    (which the caller broadcasts); every rank gets its step count, or the same
    CheckpointError. ``micro_batch``: the reproducible mode's micro-batch size of this job."""
    status, steps, message = 0, 0, b""
    if group.rank == 0:
        try:
            clean(folder)
            ckpt = latest(folder)
            if ckpt is not None:
                check_model(ckpt, {n: a for n, a in host.items() if n != GRAD_SCALE})
                for name, arr in ckpt.values.items():
                    host[name][...] = arr.reshape(host[name].shape)
                status, steps = 1, ckpt.steps_done
                if ckpt.micro_batch != micro_batch:
                    logger.warning(
                        "%s was written with reproducible_micro_batch=%d, this trainer "
                        "runs with %d: training goes on, but not bit-for-bit as without "
                        "the interruption", ckpt.path, ckpt.micro_batch, micro_batch)
                logger.info("resuming from %s (step %d, written by %d rank(s)) on %d "
                            "rank(s)", ckpt.path, steps, ckpt.ranks, group.size)
        except CheckpointError as exc:
            status, message = 2, str(exc).encode()
    header = np.array([status, steps, len(message)], np.int64)
    if group.size > 1:
        group.broadcast(header, 0, "checkpoint resume").wait()
        if header[0] == 2:
            text = np.frombuffer(message.ljust(int(header[2]), b"\0"), np.uint8).copy()
            group.broadcast(text, 0, "checkpoint resume").wait()
            message = text.tobytes()
    if header[0] == 2:
        raise CheckpointError(message.decode(errors="replace"))
    return int(header[1])


__all__ = ["Checkpoint", "DEFAULT_KEEP", "MANIFEST", "check_checkpointable", "check_model",
           "clean", "file_name", "latest", "resume", "write"]
