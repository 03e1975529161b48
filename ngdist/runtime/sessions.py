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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from ngdist.errors import NgdistError
from ngdist.runtime import blocked_conv
from ngdist.runtime.rewrites import session_rewrites
from ngdist.runtime.cuda import CudaOptions, missing

logger = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda")


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
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device,
                                                self.device_id)


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


def session_options(intra_op_threads: int | None = None) -> ort.SessionOptions:
    """onnxruntime options for ngdist's sessions: ``intra_op_threads`` (one inter-op thread),
    quiet logging, and the CPU memory arena unless ``NGDIST_CPU_ARENA=0``.

    The arena is on by default: without it the CNN step of benchmarks/cnn_step_memory.py needs
    half the memory at batch 4096 but runs slower (docs/benchmarks.md, "Peak memory").
    """
    opts = ort.SessionOptions()
    if intra_op_threads:
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.enable_cpu_mem_arena = os.environ.get("NGDIST_CPU_ARENA", "1").strip() != "0"
    if arena_limit_mb() is not None and opts.enable_cpu_mem_arena:
        _register_limited_arena(arena_limit_mb())  # type: ignore[arg-type]
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


@functools.lru_cache(maxsize=1)
def _register_limited_arena(mb: int) -> None:
    """One CPU arena of at most ``mb`` MiB registered with onnxruntime's environment, which
    sessions with ``session.use_env_allocators`` share; it grows by what is asked
    (kSameAsRequested), so its size is what the step holds, not the next power of two."""
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                             ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(mb * 2**20, 1, -1, -1))
    logger.info("onnxruntime CPU arena shared by the sessions, at most %d MiB", mb)


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
                 shapes: Mapping[str, Sequence[int]] | None = None) -> ort.InferenceSession:
    """An InferenceSession for ``model`` on ``placement``, with :func:`session_options`;
    ``optimize=False`` runs the graph as it is (no onnxruntime graph rewrites). On the CPU,
    convolutions with weights fed as inputs run on the blocked-channel kernels
    (the session rewrites of runtime/rewrites.py; ``NGDIST_CPU_BLOCKED_CONV=0`` turns that
    off); ``shapes`` gives static shapes of inputs the model leaves open. A model given as
    bytes is rewritten the same."""
    if optimize and placement.device == "cpu" and blocked_conv.requested():
        model = session_rewrites(model, nchwc_block_size, shapes)
    data = model if isinstance(model, bytes) else model.SerializeToString()
    opts = session_options(intra_op_threads)
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(data, opts, providers=placement.providers)
    wanted = placement.providers[0]
    wanted = wanted if isinstance(wanted, str) else wanted[0]
    if sess.get_providers()[0] != wanted:  # (onnxruntime falls back to the CPU silently)
        why = missing() or ("nothing ngdist knows of (onnxruntime's log at "
                            "log_severity_level=0 says why)")
        raise NgdistError(f"the session asked for {wanted} but took "
                          f"{sess.get_providers()[0]}: missing {why}; use device='cpu'")
    return sess
