"""A small fake of ``cupy`` and ``cupy.cuda.nccl`` that runs NcclGroup's own logic on the CPU.

"Device" arrays are host memory with a pointer (``a.data.ptr``); streams are worker threads
that run what is enqueued on them in order; events are markers on a stream. The NCCL module
takes pointers, counts and NCCL's dtype and op codes, exactly as cupy's does, and runs each
call over MPI on the memory those pointers address: a wrong dtype code, count or pointer gives
wrong bytes. Members of a communicator find each other through files named by the unique id
(so the id must reach every rank), then make an MPI communicator of their own
(``Create_group``: collective over the members only). Calls between ``groupStart`` and
``groupEnd`` run as one stream item (their MPI requests all posted, then completed), as NCCL
runs a group. The fake records, for the tests: every call that runs without its group's device
set on the calling thread, every ``abort``, and every device-wide synchronise.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import random
import sys
import threading
import time
import types
from typing import Any, Callable

import numpy as np

# ------------------------------------------------------------------------- what tests read
RECORD: dict[str, list[Any]] = {"no_device": [], "aborts": [], "device_syncs": [],
                                "groups": []}
_local = threading.local()


# ------------------------------------------------------------------------- cupy
class Stream:
    """A worker thread that runs enqueued callables in order (a CUDA stream)."""

    _by_ptr: dict[int, "Stream"] = {}
    _count = 0

    def __init__(self, non_blocking: bool = False) -> None:
        Stream._count += 1
        self.ptr = 0x1000 + Stream._count
        Stream._by_ptr[self.ptr] = self
        self._q: queue.Queue = queue.Queue()
        self._pending = 0  # enqueued and not yet run (counted under the condition's lock:
        self._idle = threading.Condition()  # an item enqueued as the last one ends is waited)
        self.failed: BaseException | None = None
        threading.Thread(target=self._run, daemon=True, name=f"fake-stream-{self.ptr}").start()

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            try:
                if self.failed is None:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - a failed kernel poisons the stream
                self.failed = exc
            with self._idle:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()

    def enqueue(self, fn: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        self._q.put(fn)

    def wait_event(self, event: "Event") -> None:
        flag = event.flag
        self.enqueue(lambda: flag.wait())

    def synchronize(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self._pending)

    def __enter__(self) -> "Stream":
        _stack().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stack().pop()


def _stack() -> list[Stream]:
    if not hasattr(_local, "streams"):
        _local.streams = []
    return _local.streams


NULL = Stream()


def get_current_stream() -> Stream:
    return (_stack() or [NULL])[-1]


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self.flag = threading.Event()
        self.flag.set()

    def record(self, stream: Stream | None = None) -> None:
        self.flag = flag = threading.Event()
        self.stream = stream or get_current_stream()
        self.stream.enqueue(flag.set)

    @property
    def done(self) -> bool:
        failed = getattr(getattr(self, "stream", None), "failed", None)
        if failed is not None:  # (as cudaEventQuery reports a failed kernel)
            raise RuntimeError(f"fake CUDA: a call on the stream failed: {failed!r}")
        return self.flag.is_set()


class Device:
    def __init__(self, device_id: int = 0) -> None:
        self.id = device_id

    def use(self) -> None:
        _local.device = self.id

    def synchronize(self) -> None:
        RECORD["device_syncs"].append(time.monotonic())


class ndarray:  # noqa: N801 - cupy's name
    """Host memory standing for device memory: a numpy array and its pointer."""

    def __init__(self, host: np.ndarray) -> None:
        self._a = host
        self.data = types.SimpleNamespace(ptr=host.__array_interface__["data"][0])

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    flags = property(lambda self: self._a.flags)

    def __array_namespace__(self) -> Any:
        return cupy

    def reshape(self, *shape: Any) -> "ndarray":
        return ndarray(self._a.reshape(*shape))

    def __getitem__(self, key: Any) -> "ndarray":
        return ndarray(self._a[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        src = value._a if isinstance(value, ndarray) else np.asarray(value)
        get_current_stream().enqueue(lambda: self._a.__setitem__(key, src))


def asarray(x: Any, dtype: Any = None) -> ndarray:
    get_current_stream().synchronize()
    return ndarray(np.array(x._a if isinstance(x, ndarray) else x, dtype=dtype, copy=True))


def asnumpy(x: ndarray) -> np.ndarray:
    get_current_stream().synchronize()
    return x._a.copy()


def empty(shape: Any, dtype: Any = np.float32) -> ndarray:
    return ndarray(np.empty(shape, dtype))


def _ufunc(f: Callable[..., Any]) -> Callable[..., None]:
    def run(a: ndarray, b: Any, out: ndarray) -> None:
        get_current_stream().enqueue(lambda: f(a._a, b, out=out._a))
    return run


multiply, divide, floor_divide = (_ufunc(np.multiply), _ufunc(np.divide),
                                  _ufunc(np.floor_divide))

cuda = types.SimpleNamespace(Stream=Stream, Event=Event, Device=Device,
                             ExternalStream=lambda ptr: Stream._by_ptr[ptr],
                             get_current_stream=get_current_stream,
                             runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
cupy = types.SimpleNamespace(ndarray=ndarray, asarray=asarray, asnumpy=asnumpy, empty=empty,
                             multiply=multiply, divide=divide, floor_divide=floor_divide,
                             cuda=cuda, __name__="fake_cupy")


# ------------------------------------------------------------------------- nccl
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)
DTYPE = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
         6: np.float16, 7: np.float32, 8: np.float64, 9: "bfloat16"}
available = True


def get_unique_id() -> tuple[int, ...]:
    return tuple(random.randint(-128, 127) for _ in range(128))


def _view(ptr: int, count: int, dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)
    if count == 0:
        return np.empty(0, dt)
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dt)


def _wide(a: np.ndarray) -> np.ndarray:
    """A copy to reduce: bfloat16 in float32 (MPI has no bfloat16; rounded once after)."""
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a.copy()


def groupStart() -> None:  # noqa: N802 - cupy's name
    _local.group = getattr(_local, "group", None) or []
    _local.depth = getattr(_local, "depth", 0) + 1


def groupEnd() -> None:  # noqa: N802
    _local.depth -= 1
    if _local.depth == 0:
        calls, _local.group = _local.group, None
        RECORD["groups"].append(len(calls))
        _submit(calls)


def _submit(calls: list[tuple[Any, int, Callable[[], tuple[list[Any], Callable[[], None]]]]]
            ) -> None:
    """One stream item that posts every call's MPI requests, then completes them all
    (polling, so that ``abort`` ends it)."""
    if not calls:
        return
    comm, stream_ptr = calls[0][0], calls[0][1]

    def run() -> None:
        posted = [post() for _, _, post in calls]
        reqs = [r for rs, _ in posted for r in rs]
        from mpi4py import MPI
        while not MPI.Request.Testall(reqs):
            if comm.aborted:
                return
            time.sleep(0.0005)
        for _, after in posted:
            after()
    Stream._by_ptr[stream_ptr].enqueue(run)


class NcclCommunicator:
    def __init__(self, ndev: int, comm_id: tuple[int, ...], rank: int) -> None:
        from mpi4py import MPI

        self._check_device()
        self.ndev, self.rank, self.aborted = ndev, rank, False
        tag = hashlib.sha256(bytes(v & 0xFF for v in comm_id)).hexdigest()[:16]
        folder = os.environ["NGDIST_FAKE_NCCL_DIR"]
        world = MPI.COMM_WORLD.Get_rank()
        with open(os.path.join(folder, f"{tag}.{rank}.tmp"), "w") as fh:
            fh.write(str(world))
        os.replace(os.path.join(folder, f"{tag}.{rank}.tmp"), os.path.join(folder, f"{tag}.{rank}"))
        members = []
        deadline = time.monotonic() + 60
        for r in range(ndev):  # (a rank with another id never appears: the test times out)
            path = os.path.join(folder, f"{tag}.{r}")
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake NCCL: rank {r} of id {tag} never joined")
                time.sleep(0.005)
            members.append(int(open(path).read()))
        group = MPI.COMM_WORLD.Get_group().Incl(members)
        self.mpi = MPI.COMM_WORLD.Create_group(group, tag=int(tag[:4], 16))
        assert self.mpi.Get_rank() == rank

    @staticmethod
    def _check_device() -> None:
        if getattr(_local, "device", None) is None:
            RECORD["no_device"].append(threading.current_thread().name)

    def _call(self, stream: int, post: Callable[[], tuple[list[Any], Callable[[], None]]]
              ) -> None:
        self._check_device()
        if self.aborted:
            raise RuntimeError("fake NCCL: call on an aborted communicator")
        if getattr(_local, "depth", 0):
            _local.group.append((self, stream, post))
        else:
            _submit([(self, stream, post)])

    def _mpi_op(self, op: int) -> Any:
        from mpi4py import MPI
        return {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX,
                NCCL_MIN: MPI.MIN, NCCL_AVG: MPI.SUM}[op]

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        def post():
            send, recv = _view(sendbuf, count, DTYPE[datatype]), _view(recvbuf, count, DTYPE[datatype])
            wide = send.dtype.name == "bfloat16"
            acc = _wide(send)
            if op == NCCL_AVG and acc.dtype.kind == "f":  # NCCL: each input times 1/n
                acc *= acc.dtype.type(1.0 / self.ndev)
            req = self.mpi.Iallreduce(self._mpi.IN_PLACE, acc, op=self._mpi_op(op))

            def after():
                if op == NCCL_AVG and acc.dtype.kind != "f":  # integers: C division
                    np.copyto(acc, np.trunc(acc / self.ndev).astype(acc.dtype))
                recv[...] = acc.astype(recv.dtype) if wide else acc
            return [req], after
        self._call(stream, post)

    @property
    def _mpi(self) -> Any:
        from mpi4py import MPI
        return MPI

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        def post():
            send, recv = _view(sendbuf, count, DTYPE[datatype]), _view(recvbuf, count, DTYPE[datatype])
            if self.rank == root and sendbuf != recvbuf:
                recv[...] = send
            return [self.mpi.Ibcast(recv.view(np.uint8), root=root)], lambda: None
        self._call(stream, post)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        def post():
            send, recv = _view(sendbuf, count, DTYPE[datatype]), _view(recvbuf, count, DTYPE[datatype])
            acc = _wide(send)
            req = self.mpi.Ireduce(self._mpi.IN_PLACE if self.rank == root else acc,
                                   acc if self.rank == root else None,
                                   op=self._mpi_op(op), root=root)
            return [req], (lambda: recv.__setitem__(..., acc.astype(recv.dtype))) \
                if self.rank == root else (lambda: None)
        self._call(stream, post)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        def post():
            send = _view(sendbuf, count, DTYPE[datatype]).copy()
            recv = _view(recvbuf, count * self.ndev, DTYPE[datatype])
            return [self.mpi.Iallgather(send.view(np.uint8), recv.view(np.uint8))], lambda: None
        self._call(stream, post)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        def post():
            send = _wide(_view(sendbuf, recvcount * self.ndev, DTYPE[datatype]))
            recv = _view(recvbuf, recvcount, DTYPE[datatype])
            part = np.empty(recvcount, send.dtype)
            return [self.mpi.Ireduce_scatter_block(send, part, op=self._mpi_op(op))], \
                lambda: recv.__setitem__(..., part.astype(recv.dtype))
        self._call(stream, post)

    def send(self, sendbuf, count, datatype, peer, stream):
        def post():
            data = _view(sendbuf, count, DTYPE[datatype]).view(np.uint8).copy()
            return [self.mpi.Isend(data, dest=peer, tag=7)], lambda: None
        self._call(stream, post)

    def recv(self, recvbuf, count, datatype, peer, stream):
        def post():
            data = _view(recvbuf, count, DTYPE[datatype]).view(np.uint8)
            return [self.mpi.Irecv(data, source=peer, tag=7)], lambda: None
        self._call(stream, post)

    def abort(self) -> None:
        self.aborted = True
        RECORD["aborts"].append(self.rank)
        sys.stderr.write(f"fake NCCL: ncclCommAbort on rank {self.rank}\n")
        sys.stderr.flush()

    def destroy(self) -> None:
        pass


nccl = types.SimpleNamespace(**{k: v for k, v in globals().items()
                                if k.startswith("NCCL_") or k in (
                                    "get_unique_id", "groupStart", "groupEnd",
                                    "NcclCommunicator", "available")})
MODULES = (cupy, nccl)
