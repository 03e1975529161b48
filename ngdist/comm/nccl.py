"""NcclGroup: the ProcessGroup of device buffers on NCCL (``cupy.cuda.nccl``, extra ``gpu``).

MPI stays the control plane: the group wraps a host group (``host``: an MpiGroup) that passes
the NCCL unique id from rank 0 to the others, runs barriers and splits, knows the peers'
processes (the dead-peer watch) and ends the job. Host (numpy) buffers given to the group go
to the host group unchanged, so the group serves a trainer's host-side calls too.

Streams, correct first: every call sets the group's device on the calling thread, makes the
group's one comm stream wait for the caller's current stream (the buffers are ready there),
enqueues the NCCL calls (several in one ``groupStart``/``groupEnd``), and records an event;
the Work holds the buffers until that event completes and its ``wait`` polls the event
against the group's deadline and dead-peer watch (comm/group.py: the MPI waits' own). Past
the deadline the communicator is aborted (``ncclCommAbort``), then the job, with the message
MPI waits give. Nothing here synchronises the whole device. ``overlap=True`` makes ``wait``
order the caller's stream (``compute_stream``, the sessions' own, or the current one) after
the event instead of blocking the host (``CudaOptions.overlap_streams``; off until measured on
a GPU).

``mean`` is ``ncclAvg`` where that is the sum divided by the group's size bit for bit
(floats on a power-of-two number of ranks: NCCL scales each input by 1/n, which is exact
then); elsewhere the sum, then ``divide`` on the comm stream (integers: floor division, as
every group). Gathers, broadcasts and point-to-point calls move bytes (any dtype, bfloat16
included); reductions map the dtype and refuse one NCCL has not.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ngdist.comm import watchdog
from ngdist.comm.backoff import wait_until
from ngdist.comm.group import ProcessGroup, ReduceOp, Work, describe, divide
from ngdist.comm.staged import OverHost
from ngdist.errors import CommError, NgdistError

logger = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
# numpy dtype name -> NCCL's data type (attribute of cupy.cuda.nccl, its value where an
# older cupy does not name it)
DTYPES: dict[str, tuple[str, int]] = {
    "int8": ("NCCL_INT8", 0), "uint8": ("NCCL_UINT8", 1), "int32": ("NCCL_INT32", 2),
    "uint32": ("NCCL_UINT32", 3), "int64": ("NCCL_INT64", 4), "uint64": ("NCCL_UINT64", 5),
    "float16": ("NCCL_FLOAT16", 6), "float32": ("NCCL_FLOAT32", 7),
    "float64": ("NCCL_FLOAT64", 8), "bfloat16": ("NCCL_BFLOAT16", 9)}
OPS: dict[ReduceOp, tuple[str, int]] = {
    ReduceOp.SUM: ("NCCL_SUM", 0), ReduceOp.MAX: ("NCCL_MAX", 2), ReduceOp.MIN: ("NCCL_MIN", 3),
    ReduceOp.MEAN: ("NCCL_AVG", 4)}


def nccl_modules() -> tuple[Any, Any]:
    """(cupy, cupy.cuda.nccl), or a CommError that says what to install."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise CommError(f"comm='nccl' needs cupy with NCCL: pip install 'ngdist[gpu]' "
                        f"(cupy-cuda13x; NCCL from nvidia-nccl-cu13) ({exc})") from None
    if not getattr(nccl, "available", True):
        raise CommError("comm='nccl': this cupy was built without NCCL; pip install "
                        "nvidia-nccl-cu13, or use comm='host'")
    return cupy, nccl


def _floating(dtype: Any) -> bool:
    """Floats, bfloat16 included (whose numpy kind is not "f")."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _code(nccl: Any, entry: tuple[str, int]) -> int:
    return int(getattr(nccl, entry[0], entry[1]))


class NcclWork(Work):
    """An event recorded on the comm stream after the call; holds its buffers until then."""

    def __init__(self, group: NcclGroup, event: Any, keep: Sequence[Any], what: Any,
                 peers: Sequence[int] | None) -> None:
        super().__init__(group, what, peers)
        self.event = event
        self.keep: list[Any] | None = list(keep)
        self.started = time.monotonic()

    def test(self) -> bool:
        if self.keep is None:
            return True
        if self.group.aborted:  # (an aborted communicator's calls end without their result)
            while self.group.ending:  # the job ends now (NcclGroup.abort): never go on
                time.sleep(1)
            raise CommError(f"{describe(self.what)} cannot complete: this rank's NCCL "
                            "communicator was aborted after an earlier failure")
        if not self.event.done:
            return False
        self.keep = None  # (the buffers may go: NCCL no longer reads or writes them)
        return True

    def _block(self) -> None:
        wait_until(self.test)

    def _poll(self, sleep_s: float) -> None:
        try:
            super()._poll(sleep_s)
        except NgdistError:  # past the deadline or a peer gone: NCCL must not wait on
            self.group.abort_communicator()
            raise

    def wait(self, gentle: bool = False) -> None:
        group = self.group
        if group.overlap and self.keep is not None:  # the caller's stream waits, not the host
            group.caller_stream().wait_event(self.event)
            group.in_flight.append(self)
            return
        super().wait(gentle)


class NcclGroup(OverHost):
    """See the module docstring. ``host``: the control-plane group over the same ranks;
    ``device_id``: the GPU (default: the rank's place on its host, modulo the GPUs);
    ``modules``: (cupy, cupy.cuda.nccl), for tests."""

    backend = "nccl"

    def __init__(self, host: ProcessGroup, device_id: int | None = None, *,
                 overlap: bool = False, compute_stream: int | None = None,
                 modules: tuple[Any, Any] | None = None) -> None:
        self.cupy, self.nccl = modules or nccl_modules()
        super().__init__(host)
        self.overlap = overlap
        self.compute_stream = compute_stream  # the sessions' cudaStream_t, where they share one
        self.in_flight: list[NcclWork] = []  # overlapped Works whose buffers are still held
        self.aborted = False
        self.closed = False  # close() freed the communicator
        self.ending = False  # the job is being ended (abort): waits never return
        if device_id is None:
            device_id = host.local_rank % self.cupy.cuda.runtime.getDeviceCount()
        self.device_id = device_id
        self._use()
        self.stream = self.cupy.cuda.Stream(non_blocking=True)
        self._compute = None if compute_stream is None else \
            self.cupy.cuda.ExternalStream(compute_stream)
        uid = np.zeros(UNIQUE_ID_BYTES, np.int64)
        if self.rank == 0:
            uid[:] = self.nccl.get_unique_id()
        host.broadcast(uid, 0, "start-up: the NCCL unique id").wait()
        self.comm = self.nccl.NcclCommunicator(self.size, tuple(int(v) for v in uid),
                                               self.rank)

    # ------------------------------------------------------------------ plumbing
    def caller_stream(self) -> Any:
        """The stream the buffers are made and read on: the sessions' own where they share
        one (``compute_stream``), else the calling thread's current stream."""
        return self._compute if self._compute is not None else \
            self.cupy.cuda.get_current_stream()

    def _use(self) -> None:
        """This group's device on the calling thread (NCCL calls run on any thread)."""
        self.cupy.cuda.Device(self.device_id).use()

    def _dtype(self, buf: Any, what: Any) -> int:
        name = np.dtype(buf.dtype).name
        if name not in DTYPES:
            raise CommError(f"NCCL cannot reduce {name} values ({what}); NCCL reduces "
                            f"{sorted(DTYPES)}")
        return _code(self.nccl, DTYPES[name])

    def _start(self, calls: Callable[[], None], keep: Sequence[Any], what: Any,
               peers: Sequence[int] | None = None, grouped: bool = False) -> NcclWork:
        """The comm stream waits for the caller's stream, ``calls`` enqueue (in one NCCL
        group when ``grouped``), an event marks their end."""
        if self.aborted:
            raise CommError(f"{what}: this rank's NCCL communicator was aborted after an "
                            "earlier failure; the job cannot go on")
        if self.closed:
            raise CommError(f"{what}: this rank's NCCL communicator was closed "
                            "(trainer.close()); make a new trainer to train on")
        self._use()
        self._check_in_flight()
        cuda = self.cupy.cuda
        ready = cuda.Event(block=False, disable_timing=True)
        ready.record(self.caller_stream())
        self.stream.wait_event(ready)
        if grouped:
            self.nccl.groupStart()
        try:
            calls()
        finally:
            if grouped:
                self.nccl.groupEnd()
        done = cuda.Event(block=False, disable_timing=True)
        done.record(self.stream)
        return NcclWork(self, done, keep, what, peers)

    def _check_in_flight(self) -> None:
        """Overlapped Works still pending (their buffers held): one past the deadline ends
        the job as a blocked wait would (the host never waited for it)."""
        now = time.monotonic()
        self.in_flight = [w for w in self.in_flight if not w.test()]
        late = next((w for w in self.in_flight if now - w.started > self.timeout), None)
        if late is not None:  # (the watchdog's own ending: message, abort)
            watchdog._abort(late, "CommTimeoutError",
                            self.timeout_message(late.what, late.peers))

    @staticmethod
    def _host(*bufs: Any) -> bool:
        return all(b is None or isinstance(b, np.ndarray) for b in bufs)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, buf, what, op=ReduceOp.SUM, peers=None, placed=None):
        return self.allreduce_coalesced([buf], what, op, peers)

    def allreduce_coalesced(self, bufs, what, op=ReduceOp.SUM, peers=None, placed=None):
        op = ReduceOp(op)
        if self._host(*bufs):
            return self.host.allreduce_coalesced(bufs, what, op, peers, placed)
        codes = [self._dtype(b, what) for b in bufs]
        avg = [op is ReduceOp.MEAN and _floating(b.dtype) and self.size & (self.size - 1) == 0
               for b in bufs]
        s = self.stream.ptr

        def calls() -> None:
            for b, code, a in zip(bufs, codes, avg):
                nop = OPS[ReduceOp.MEAN if a else ReduceOp.SUM if op.summed else op]
                self.comm.allReduce(b.data.ptr, b.data.ptr, b.size, code, _code(self.nccl, nop), s)
        for b in bufs:
            self.bytes_sent += b.nbytes
        work = self._start(calls, bufs, what, peers, grouped=len(bufs) > 1)
        rest = [b for b, a in zip(bufs, avg) if op is ReduceOp.MEAN and not a]
        if rest:  # the sum, divided on the comm stream (ordered before the event below)
            with self.stream:
                for b in rest:
                    divide(b, self.size)
            work.event.record(self.stream)
        return work

    def broadcast(self, buf, root, what):
        if self._host(buf):
            return self.host.broadcast(buf, root, what)
        self.bytes_sent += buf.nbytes if self.rank == root else 0
        p = buf.data.ptr
        return self._start(lambda: self.comm.broadcast(
            p, p, buf.nbytes, _code(self.nccl, DTYPES["uint8"]), root, self.stream.ptr),
            [buf], what, None if self.rank == root else [root])

    def reduce(self, send, recv, root, what):
        if self._host(send, recv):
            return self.host.reduce(send, recv, root, what)
        code = self._dtype(send, what)
        rp = recv.data.ptr if self.rank == root else send.data.ptr
        self.bytes_sent += 0 if self.rank == root else send.nbytes
        return self._start(lambda: self.comm.reduce(
            send.data.ptr, rp, send.size, code, _code(self.nccl, OPS[ReduceOp.SUM]), root,
            self.stream.ptr), [send, recv], what)

    def allgather(self, send, recv, what):
        if self._host(send, recv):
            return self.host.allgather(send, recv, what)
        self.bytes_sent += recv.nbytes // 2  # half an AllReduce (comm/group.py)
        return self._start(lambda: self.comm.allGather(
            send.data.ptr, recv.data.ptr, send.nbytes, _code(self.nccl, DTYPES["uint8"]),
            self.stream.ptr), [send, recv], what)

    def gather(self, send, recv, root, what):
        if self._host(send, recv):
            return self.host.gather(send, recv, root, what)
        u8, s, n = _code(self.nccl, DTYPES["uint8"]), self.stream.ptr, send.nbytes

        def calls() -> None:
            if self.rank == root:
                for r in range(self.size):
                    self.comm.recv(recv.data.ptr + r * n, n, u8, r, s)
            self.comm.send(send.data.ptr, n, u8, root, s)
        self.bytes_sent += 0 if self.rank == root else n
        return self._start(calls, [send, recv], what,
                           None if self.rank == root else [root], grouped=True)

    def reduce_scatter(self, send, recv, what):
        if self._host(send, recv):
            return self.host.reduce_scatter(send, recv, what)
        code = self._dtype(send, what)
        self.bytes_sent += send.nbytes // 2  # half an AllReduce (comm/group.py)
        return self._start(lambda: self.comm.reduceScatter(
            send.data.ptr, recv.data.ptr, recv.size, code,
            _code(self.nccl, OPS[ReduceOp.SUM]), self.stream.ptr), [send, recv], what)

    def exchange(self, sends, recvs, tag, what):
        """Grouped send/recv (NCCL has no tags: the calls pair in program order)."""
        bufs = [b for b, _ in (*sends, *recvs)]
        if self._host(*bufs):
            return self.host.exchange(sends, recvs, tag, what)
        u8, s = _code(self.nccl, DTYPES["uint8"]), self.stream.ptr

        def calls() -> None:
            for buf, src in recvs:
                self.comm.recv(buf.data.ptr, buf.nbytes, u8, src, s)
            for buf, dst in sends:
                self.comm.send(buf.data.ptr, buf.nbytes, u8, dst, s)
        self.bytes_sent += sum(b.nbytes for b, _ in sends)
        peers = sorted({p for _, p in (*sends, *recvs)})
        return self._start(calls, bufs, what, peers, grouped=True)

    def split(self, color, key, what):
        sub = self.host.split(color, key, what)
        return None if sub is None else self._derived(sub)

    def dup(self, what):
        return self._derived(self.host.dup(what))

    def _derived(self, host: ProcessGroup) -> NcclGroup:
        return NcclGroup(host, self.device_id, overlap=self.overlap,
                         compute_stream=self.compute_stream, modules=(self.cupy, self.nccl))

    # ------------------------------------------------------------------ failures
    def abort_communicator(self) -> None:
        """``ncclCommAbort``: NCCL's kernels of this communicator stop waiting (once)."""
        if not self.aborted:
            self.aborted = True
            try:
                self.comm.abort()
            except Exception as exc:  # noqa: BLE001 - the job ends next; say why, go on
                logger.warning("ncclCommAbort failed: %s", exc)

    def abort(self, message, code=1):
        self.ending = True
        self.abort_communicator()
        super().abort(message, code)

    def close(self) -> None:
        """Completes what is in flight, then frees the communicator; once (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        for work in self.in_flight:
            work.keep and wait_until(work.test)
        if not self.aborted:
            self.comm.destroy()


def device_group(host: ProcessGroup, comm: str, device_id: int,
                 compute_stream: int | None = None) -> ProcessGroup:
    """The group for device buffers: ``comm="nccl"`` an NcclGroup over ``host`` (the host
    group, which kernels stage through, where cupy or NCCL is missing: logged), ``"host"``
    the host group itself (device buffers staged by the kernels, kernels/host_staged.py).
    ``compute_stream``: the sessions' shared stream when they overlap with communication
    (the Works then order that stream instead of blocking the host)."""
    if comm not in ("host", "nccl"):
        raise CommError(f"comm={comm!r}: choose 'host' (staged through host memory) or 'nccl'")
    if comm == "host" or host.size == 1:
        return host
    try:
        modules = nccl_modules()
    except CommError as exc:
        logger.warning("%s; communicating through host memory instead", exc)
        return host
    return NcclGroup(host, device_id, overlap=compute_stream is not None,
                     compute_stream=compute_stream, modules=modules)
