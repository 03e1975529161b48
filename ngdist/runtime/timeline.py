"""The timeline of a training job: one Chrome trace-event JSON file for every rank.

``NGDIST_TIMELINE=trace.json`` (or ``timeline=`` of ``ngdist.compile`` / the Trainer, ``ngdist
run --timeline``, ``ngdist train --timeline``) records what each rank does, as Horovod's
``HOROVOD_TIMELINE``: Perfetto and chrome://tracing open the file. Each rank is a process
(``pid`` = rank, named ``rank N``), each thread of it a thread (``main``, ``comm``: the
executor's communication thread under ``overlap``), and the spans are

* ``step``: ``step N``, one per training step, on the main thread (args: samples, bytes sent,
  the loss when the step fetched it);
* ``feed``: a rank's slice of the global batch (``trainer.shard``) and the batch checked,
  cast and placed as the step's inputs;
* ``compute``: one onnxruntime session run, named by the first and last node of its segment;
* ``comm``: one comm op (args: op, value/bucket name, bytes this rank sent, algorithm, group
  size);
* ``wait``: the main thread waiting for a comm op's result (``StepStats.wait_time``), and a
  thread blocked in ``Work.wait`` (the backend's own wait).

Recording is an append of a tuple to a list (a comm op's, a step's and a wait's args dict is
built with it; a segment's is made once; nothing is serialised per event); every hook is one
``if timeline is not None`` check, so a job without a timeline builds nothing.

Clock: rank 0's ``time.perf_counter()``, from its start of the timeline. Every other rank
measures the offset of its own ``perf_counter`` against rank 0's at the start, as Cristian's
algorithm does: ``CLOCK_ROUNDS`` ping-pongs with rank 0 through the ProcessGroup, each giving
bounds on the offset from the send and receive times; the round with the shortest round trip
gives the offset (its midpoint, wrong by at most half that round trip: microseconds on one
host). A rank descheduled in some round (a busy host) costs that round only. The monotonic
clock never jumps with NTP corrections; rank 0's wall-clock time at the start is in the file
(``otherData.start_unix_ns``).

Writing is collective: ``write()`` (``trainer.write_timeline()``, ``trainer.close()``, or at
interpreter exit on every rank whose trainer was not closed) serialises each rank's events,
gathers them to rank 0 through the ProcessGroup (one gather of bytes) and rank 0 writes the one
file atomically. A later write rewrites it with everything recorded so far.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ngdist.comm.group import ProcessGroup
from ngdist.errors import InputError
from ngdist.ir.atomic import write_atomic

logger = logging.getLogger(__name__)

ENV = "NGDIST_TIMELINE"
CLOCK_ROUNDS = 10  # ping-pongs with rank 0 per rank; the shortest round trip counts
_CLOCK_TAG = 7_301
_THREAD_NAMES = {"MainThread": "main"}  # recorded thread name -> shown name (prefix match below)
_THREAD_PREFIXES = (("ngdist-comm", "comm"), ("ngdist-replica", "replica"))


def timeline_path(given: str | os.PathLike | bool | None) -> Path | None:
    """The file to write: ``given``, else ``NGDIST_TIMELINE``; None when off (``False`` is
    off whatever the environment says). Made absolute (ranks may change directory)."""
    if given is False:
        return None
    raw = os.environ.get(ENV, "") if given is None or given is True else os.fspath(given)
    if given is True and not raw:
        raise InputError(f"timeline=True needs the file in {ENV}; pass timeline='trace.json' "
                         "instead")
    return Path(raw).expanduser().absolute() if raw else None


def check_path(path: Path) -> None:
    """A timeline file must go into a folder that exists, and not be a folder itself."""
    if path.is_dir():
        raise InputError(f"timeline {path} is a directory; give a file name, e.g. "
                         f"{path / 'trace.json'}")
    if not path.parent.is_dir():
        raise InputError(f"timeline {path}: the directory {path.parent} does not exist; create "
                         "it first or choose another path for the timeline")


def _thread_label(name: str) -> str:
    """``main``, ``comm``, ``replica_N``, or the thread's own name."""
    if name in _THREAD_NAMES:
        return _THREAD_NAMES[name]
    for prefix, label in _THREAD_PREFIXES:
        if name.startswith(prefix):
            return label if label == "comm" else label + name[len(prefix):]
    return name


def _job_origin(group: ProcessGroup) -> float:
    """Collective: the value of this rank's ``perf_counter`` when rank 0's read its time 0
    (module docstring: best round of ``CLOCK_ROUNDS`` ping-pongs with rank 0)."""
    what = "timeline: clock offsets"
    if group.size == 1:
        return time.perf_counter()
    times = np.zeros(2, np.float64)
    table = np.zeros(group.size + 1, np.float64)  # rank 0's time 0, then each rank's offset
    if group.rank == 0:
        ping = np.zeros(1, np.float64)
        for r in range(1, group.size):
            best = (float("inf"), 0.0)
            for _ in range(CLOCK_ROUNDS):
                sent = time.perf_counter()
                group.exchange([(ping, r)], [], _CLOCK_TAG, what).wait()
                group.exchange([], [(times, r)], _CLOCK_TAG, what).wait()
                back = time.perf_counter()
                got, replied = times
                # r's clock minus rank 0's lies in [replied - back, got - sent]
                trip = (back - sent) - (replied - got)
                best = min(best, (trip, ((replied - back) + (got - sent)) / 2))
            table[r + 1] = best[1]
        table[0] = time.perf_counter()
    else:
        ping = np.zeros(1, np.float64)
        for _ in range(CLOCK_ROUNDS):
            group.exchange([], [(ping, 0)], _CLOCK_TAG, what).wait()
            times[0] = time.perf_counter()
            times[1] = time.perf_counter()
            group.exchange([(times, 0)], [], _CLOCK_TAG, what).wait()
    group.broadcast(table, 0, what).wait()
    return float(table[0] + table[group.rank + 1])


class Timeline:
    """Spans of this rank, and the collective write of the job's file (module docstring).

    Collective to create (the start barrier) and to ``write``; ``record`` is thread-safe
    (a list append under the GIL)."""

    def __init__(self, path: Path, group: ProcessGroup) -> None:
        self.path = path
        self.group = group
        self.events: list[tuple[str, str, int, float, float, Any]] = []
        self.threads: dict[int, str] = {}
        self.closed = False
        self.origin = _job_origin(group)  # this rank's perf_counter at rank 0's time 0
        self.start_unix_ns = time.time_ns()
        atexit.register(self._at_exit)

    def record(self, cat: str, name: str, t0: float, t1: float, args: Any = None) -> None:
        """One span of category ``cat`` from ``t0`` to ``t1`` (``time.perf_counter()``) on
        the calling thread; ``args``: a dict shown with the span, or None."""
        ident = threading.get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        self.events.append((cat, name, ident, t0, t1, args))

    # ------------------------------------------------------------------ writing
    def trace_events(self) -> list[dict[str, Any]]:
        """This rank's events in the trace-event format (microseconds from the start)."""
        rank = self.group.world_ranks()[self.group.rank]
        labels = {ident: _thread_label(name) for ident, name in self.threads.items()}
        order = sorted(set(labels.values()), key=lambda s: (s != "main", s != "comm", s))
        tids = {label: i for i, label in enumerate(order)}
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
        for label, tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                        "args": {"name": label}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                        "args": {"sort_index": tid}})
        origin = self.origin
        for cat, name, ident, t0, t1, args in list(self.events):
            event = {"ph": "X", "cat": cat, "name": name, "pid": rank,
                     "tid": tids[labels[ident]], "ts": round((t0 - origin) * 1e6, 3),
                     "dur": round((t1 - t0) * 1e6, 3)}
            if args:
                event["args"] = args
            out.append(event)
        return out

    def write(self) -> Path:
        """Collective: every rank's events reach rank 0, which writes the one file."""
        group = self.group
        payload = np.frombuffer(json.dumps(self.trace_events()).encode(), np.uint8)
        parts = [payload]
        if group.size > 1:
            sizes = np.empty(group.size, np.int64)
            group.allgather(np.array([payload.size], np.int64), sizes,
                            "timeline: event sizes").wait()
            row = np.zeros(int(sizes.max()), np.uint8)
            row[:payload.size] = payload
            table = np.empty((group.size, row.size), np.uint8) if group.rank == 0 else None
            group.gather(row, table, 0, "timeline: events").wait()
            if table is not None:
                parts = [table[r, :sizes[r]] for r in range(group.size)]
        if group.rank == 0:  # the ranks' JSON lists spliced into one, not parsed again
            events = b",".join(p.tobytes()[1:-1] for p in parts if p.size > 2)
            other = json.dumps({"ranks": group.size, "start_unix_ns": self.start_unix_ns,
                                "clock": "perf_counter of each rank from a common start "
                                         "barrier, in microseconds"})
            write_atomic(self.path, b'{"traceEvents": [' + events +
                         b'], "displayTimeUnit": "ms", "otherData": ' + other.encode() + b"}")
            logger.info("timeline of %d rank(s), %d bytes: %s", group.size, len(events),
                        self.path)
        return self.path

    def close(self) -> None:
        """Collective: the final write; nothing is written at exit afterwards."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        self.write()

    def _at_exit(self) -> None:  # every rank that did not close its trainer gets here
        if not self.closed:
            self.close()
