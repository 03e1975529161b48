"""Placement and the one session factory: every onnxruntime session of ngdist comes from here.

A :class:`Placement` says where a trainer's values live and run: ``cpu``, or ``cuda`` with a
device id. ``make_session`` builds an ``InferenceSession`` for a model on that placement with
ngdist's options (threads, quiet logging, the CPU memory arena unless ``NGDIST_CPU_ARENA=0``,
one arena of at most ``NGDIST_CPU_ARENA_MAX_MB`` MiB shared by the process's sessions when set,
graph optimisations), so that no part of the package builds sessions its own way.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from ngdist.errors import NgdistError, OutOfMemoryError
from ngdist.runtime import blocked_conv
from ngdist.runtime.rewrites import session_bytes, session_rewrites
from ngdist.runtime.cuda import CudaOptions, missing

logger = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda")
# onnxruntime's memory-reuse planner looks each new value up against every buffer freed
# before it: quadratic in a graph's values. Sessions of graphs with more nodes than this are
# planned without it (``enable_mem_reuse`` off); freed memory is still reused, by the arena,
# and the results are the same bits (docs/benchmarks.md, "Compile time").
REUSE_PLAN_MAX_NODES = 4000


@dataclass(frozen=True)
class Placement:
    """Where values live and compute runs: ``device`` ``cpu`` or ``cuda``, and its id."""

    device: str = "cpu"
    device_id: int = 0
    cuda: CudaOptions = CudaOptions()  # the CUDA provider's options (runtime/cuda.py)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise NgdistError(f"unknown device {self.device!r}; choose one of {list(DEVICES)}")

    @property
    def providers(self) -> list[str | tuple[str, dict[str, str]]]:
        if self.device == "cuda":
            return [("CUDAExecutionProvider", self.cuda.provider_options(self.device_id)),
                    "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    @property
    def ort_device(self) -> str:
        """The device name IOBinding and OrtValue take."""
        return self.device

    def value(self, array: np.ndarray, onnx_type: int | None = None) -> ort.OrtValue:
        """An OrtValue on this placement holding ``array`` (on CPU: the array itself, no copy;
        keep the array alive as long as the value). ``onnx_type`` reinterprets the array's
        elements as that ONNX type of the same size (``uint16`` bits as bfloat16)."""
        if onnx_type is not None:
            if self.device != "cpu":
                raise NgdistError(f"{onnx.TensorProto.DataType.Name(onnx_type)} values are "
                                  f"made only on the CPU placement, not {self.device!r}")
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, onnx_type)
        if self.device == "cpu":
            return ort.OrtValue.ortvalue_from_numpy(array)
        # np.require keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d)
        return ort.OrtValue.ortvalue_from_numpy(np.require(array, requirements="C"),
                                                self.device, self.device_id)


CPU = Placement()


def gpu_count() -> int:
    """The GPUs onnxruntime sees on this machine (0 without one)."""
    try:
        from onnxruntime.capi import _pybind_state as C

        return sum(1 for h in C.get_hardware_devices() if h.type.name == "GPU")
    except (ImportError, AttributeError):  # an onnxruntime without device discovery
        return 0


def placement_for(device: str | None, local_rank: int = 0,
                  cuda: CudaOptions | None = None) -> Placement:
    """``cpu`` (default), ``cuda`` (rank r on GPU ``local_rank % count``) or ``auto`` (``cuda``
    when it is usable, else ``cpu``). ``cuda`` fails at once, saying what is missing, when
    onnxruntime has no CUDA provider or sees no GPU, or when a buffer cannot be placed on the
    GPU (no CUDA runtime)."""
    if device in (None, "cpu"):
        return CPU
    if device == "auto":
        try:
            return placement_for("cuda", local_rank, cuda)
        except NgdistError as exc:
            logger.info("device='auto': CPU (%s)", exc)
            return CPU
    if device != "cuda":
        raise NgdistError(f"unknown device {device!r}; choose one of "
                          f"{[*DEVICES, 'auto']}")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise NgdistError("device='cuda' needs onnxruntime with the CUDA execution provider: "
                          "pip install onnxruntime-gpu (a CUDA 13 build from 1.27 on); this "
                          f"onnxruntime has {ort.get_available_providers()}")
    absent = missing()
    if absent:
        raise NgdistError(f"device='cuda': onnxruntime's CUDA provider cannot load, missing "
                          f"{absent}; use device='cpu' (or 'auto' to pick CUDA only when it "
                          "is usable)")
    count = gpu_count()
    if count == 0:
        raise NgdistError("device='cuda': onnxruntime has the CUDA execution provider but sees "
                          "no GPU on this machine; use device='cpu' (or 'auto' to pick CUDA "
                          "only when it is usable)")
    placement = Placement("cuda", local_rank % count, cuda or CudaOptions())
    try:
        placement.value(np.zeros(1, np.float32))
    except Exception as exc:  # noqa: BLE001 - any failure means CUDA is not usable here
        raise NgdistError(f"device='cuda': a buffer cannot be placed on GPU "
                          f"{placement.device_id}: {exc}. Check the CUDA runtime (onnxruntime-gpu "
                          "from 1.27 on needs CUDA 13) and the driver") from None
    return placement


def session_options(intra_op_threads: int | None = None, shared_arena: bool = False,
                    device: str = "cpu") -> ort.SessionOptions:
    """onnxruntime options for ngdist's sessions: ``intra_op_threads`` (one inter-op thread),
    quiet logging, and the CPU memory arena unless ``NGDIST_CPU_ARENA=0``: the session's own,
    or with ``shared_arena`` or ``NGDIST_CPU_ARENA_MAX_MB`` one arena shared by the process's
    sessions (capped by the latter).

    On the CPU the memory pattern is off: onnxruntime records a run's allocations and from
    the second run on takes them as one block, which the arena cannot carve from the chunks
    the first run left free, so it holds a second set of activations for good (a step's
    resident size grew by its activations at step 2). The arena serves each allocation from
    those chunks instead, at the same step time (docs/benchmarks.md, "Memory pattern").

    The arena is on by default: without it the CNN step of benchmarks/cnn_step_memory.py needs
    half the memory at batch 4096 but runs slower (docs/benchmarks.md, "Peak memory"). A
    session's own arena keeps the largest size it reached; the sessions of a step cut into
    many segments (a sharded step's) share one, which holds what is alive at once, not the
    sum of each segment's peak.
    """
    opts = ort.SessionOptions()
    if intra_op_threads:
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.enable_mem_pattern = device != "cpu"
    opts.enable_cpu_mem_arena = os.environ.get("NGDIST_CPU_ARENA", "1").strip() != "0"
    limit = arena_limit_mb()
    if opts.enable_cpu_mem_arena and (limit is not None or shared_arena):
        _register_shared_arena(limit or 0)
        opts.add_session_config_entry("session.use_env_allocators", "1")
    return opts


def arena_limit_mb() -> int | None:
    """``NGDIST_CPU_ARENA_MAX_MB``: the most MiB onnxruntime's CPU arena may hold in this
    process, all sessions together (one arena shared by them); None when unset."""
    text = os.environ.get("NGDIST_CPU_ARENA_MAX_MB", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise NgdistError(f"NGDIST_CPU_ARENA_MAX_MB={text!r}: give a whole number of MiB "
                          "(at least 1), or unset it for an arena without a limit")
    return int(text)


# onnxruntime refusing an allocation: its arena's limit reached (the second form), or no memory
# left for the arena or the allocator (the first)
_ALLOCATION_FAILED = re.compile(r"(?:Failed to allocate memory for requested buffer of size|"
                                r"(is) smaller than requested bytes of) (\d+)")


# an MPI call that could not allocate its buffers (MPICH's error stack, Open MPI's class)
_MPI_OUT_OF_MEMORY = re.compile(r"MPI.*(?:Out of memory|MPI_ERR_NO_MEM)", re.S)


def memory_limit(refused_by: str) -> str:
    """The limit in force, in words, for an allocation ``refused_by`` ``arena`` (onnxruntime's
    capped arena), ``onnxruntime`` (its allocator, or the arena's growth), ``numpy`` or ``mpi``:
    the
    arena's limit (``NGDIST_CPU_ARENA_MAX_MB``), else the process's address space limit
    (``RLIMIT_AS``), else none."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    capped = arena_limit_mb() is not None
    if refused_by == "arena" and capped or \
            refused_by == "onnxruntime" and capped and soft == resource.RLIM_INFINITY:
        return f"onnxruntime's CPU arena is limited to {arena_limit_mb()} MiB " \
            "(NGDIST_CPU_ARENA_MAX_MB)"
    if soft != resource.RLIM_INFINITY:
        return f"this process's address space is limited to {soft >> 20} MiB (RLIMIT_AS)"
    return "this process has no more memory"


def out_of_memory(where: str, exc: BaseException) -> OutOfMemoryError | None:
    """The error of an allocation refused in ``where`` (onnxruntime's, numpy's
    ``MemoryError``, MPI's): the limit in force, what was asked and what to do; None when
    ``exc`` is no allocation failure."""
    found = _ALLOCATION_FAILED.search(str(exc))
    if found is not None:
        refused_by, asked = "arena" if found.group(1) else "onnxruntime", found.group(2)
    elif isinstance(exc, MemoryError):
        shape, dtype = getattr(exc, "shape", None), getattr(exc, "dtype", None)
        refused_by = "numpy"
        asked = "?" if shape is None or dtype is None else \
            str(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    elif _MPI_OUT_OF_MEMORY.search(str(exc)):  # MPI's buffer of a collective
        refused_by, asked = "mpi", "?"
    else:
        return None
    asked = "more" if asked == "?" else f"{asked} bytes more"
    return OutOfMemoryError(f"out of memory in {where}: {memory_limit(refused_by)} and the step "
                            f"asked for {asked}; raise the limit, shard the parameters over "
                            "the ranks (shard='parameters'), or use smaller batches")


_SHARED_ARENA: list[int] = []  # the limit (MiB; 0: none) of the arena registered here


def _register_shared_arena(mb: int) -> None:
    """One CPU arena of at most ``mb`` MiB (0: no limit) registered with onnxruntime's
    environment, once per process, which sessions with ``session.use_env_allocators`` share;
    it grows by what is asked (kSameAsRequested), so its size is what the step holds, not the
    next power of two."""
    if _SHARED_ARENA:
        if _SHARED_ARENA[0] != mb:
            logger.warning("onnxruntime's shared CPU arena keeps its limit of %s MiB (it is "
                           "registered once per process)", _SHARED_ARENA[0] or "no")
        return
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                             ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(mb * 2**20, 1, -1, -1))
    _SHARED_ARENA.append(mb)
    logger.info("onnxruntime CPU arena shared by the sessions, %s",
                f"at most {mb} MiB" if mb else "no limit")


@functools.lru_cache(maxsize=1)
def nchwc_block_size() -> int:
    """Channels per block of onnxruntime's NCHWc CPU kernels here; 0 where there are none
    (a build or CPU without them: onnxruntime does not know the probe's ReorderInput, or has
    no kernel for it). Any other failure of the probe is raised: it is a broken install or
    a bug, not a CPU without the kernels."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, NotImplemented

    try:
        sess = ort.InferenceSession(blocked_conv.probe_model().SerializeToString(),
                                    providers=["CPUExecutionProvider"])
    except (Fail, NotImplemented) as exc:
        if f"{blocked_conv.DOMAIN}:ReorderInput" not in str(exc) and \
                "implementation for ReorderInput" not in str(exc):
            raise
        logger.info("no NCHWc kernels in this onnxruntime build or on this CPU: %s", exc)
        return 0
    return int(sess.run(None, {"x": np.zeros([1, 4, 1, 1], np.float32)})[0].shape[1])


def make_session(model: onnx.ModelProto | bytes, placement: Placement = CPU,
                 intra_op_threads: int | None = None, optimize: bool = True,
                 shapes: Mapping[str, Sequence[int]] | None = None,
                 shared_arena: bool = False) -> ort.InferenceSession:
    """An InferenceSession for ``model`` on ``placement``, with :func:`session_options`;
    ``optimize=False`` runs the graph as it is (no onnxruntime graph rewrites). A graph of
    more than ``REUSE_PLAN_MAX_NODES`` nodes is planned without onnxruntime's memory-reuse
    plan (quadratic in the graph's size; the arena reuses freed memory); a large proto goes to
    onnxruntime with its shape computations first (``rewrites.shapes_first``). On the CPU,
    convolutions with weights fed as inputs run on the blocked-channel kernels
    (the session rewrites of runtime/rewrites.py; ``NGDIST_CPU_BLOCKED_CONV=0`` turns that
    off); ``shapes`` gives static shapes of inputs the model leaves open. A model given as
    bytes is rewritten the same. ``shared_arena``: see :func:`session_options`."""
    if optimize and placement.device == "cpu" and blocked_conv.requested():
        model = session_rewrites(model, nchwc_block_size, shapes)
    data = model if isinstance(model, bytes) else session_bytes(model)
    opts = session_options(intra_op_threads, shared_arena, placement.device)
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.enable_mem_reuse = plans_reuse(model)
    sess = ort.InferenceSession(data, opts, providers=placement.providers)
    wanted = placement.providers[0]
    wanted = wanted if isinstance(wanted, str) else wanted[0]
    if sess.get_providers()[0] != wanted:  # (onnxruntime falls back to the CPU silently)
        why = missing() or ("nothing ngdist knows of (onnxruntime's log at "
                            "log_severity_level=0 says why)")
        raise NgdistError(f"the session asked for {wanted} but took "
                          f"{sess.get_providers()[0]}: missing {why}; use device='cpu'")
    return sess


def node_count(model: onnx.ModelProto | bytes) -> int:
    """The number of nodes of ``model``'s main graph (a model given as bytes is parsed)."""
    return len((onnx.ModelProto.FromString(model) if isinstance(model, bytes) else model
                ).graph.node)


def plans_reuse(model: onnx.ModelProto | bytes) -> bool:
    """Whether a session of ``model`` gets onnxruntime's memory-reuse plan
    (``SessionOptions.enable_mem_reuse``): not above ``REUSE_PLAN_MAX_NODES`` nodes."""
    return node_count(model) <= REUSE_PLAN_MAX_NODES
