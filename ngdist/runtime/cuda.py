"""onnxruntime's CUDA provider: its typed options, and what it is missing where it cannot load.

:class:`CudaOptions` are the CUDA provider options ngdist exposes (``ngdist.compile(...,
cuda=CudaOptions(use_tf32=False))``); a field left at None keeps onnxruntime's own default and
is not passed. :func:`missing` names the libraries the provider cannot find and the package
that provides each: onnxruntime lists the CUDA provider as available even when its library
cannot load, and a session then runs on the CPU without a word (runtime/sessions.py checks).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields
from typing import Any

from ngdist.errors import OptionError

# the libraries onnxruntime-gpu's CUDA 13 provider links (readelf -d: NEEDED) and loads at run
# time (cuDNN, at the first convolution), with the package that provides each
DEPENDENCIES: tuple[tuple[str, str], ...] = (
    ("libcublasLt.so.13", "pip install nvidia-cublas"),
    ("libcublas.so.13", "pip install nvidia-cublas"),
    ("libcurand.so.10", "pip install nvidia-curand"),
    ("libcudart.so.13", "pip install nvidia-cuda-runtime"),
    ("libcuda.so.1", "the NVIDIA driver: a machine with a GPU"),
    ("libcudnn.so.9", "pip install nvidia-cudnn-cu13"),
)
CONV_ALGO_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
ARENA_EXTEND = ("kNextPowerOfTwo", "kSameAsRequested")
COMMS = ("host", "nccl")


@dataclass(frozen=True)
class CudaOptions:
    """The CUDA provider's options (None: onnxruntime's default).

    ``use_tf32``: TF32 for float32 matrix products (onnxruntime's default: on; off to match
    the CPU path to ~1e-6); ``cudnn_conv_algo_search``: EXHAUSTIVE, HEURISTIC or DEFAULT;
    ``arena_extend_strategy`` (kNextPowerOfTwo or kSameAsRequested) and ``gpu_mem_limit``
    (bytes): the device memory arena; ``user_compute_stream``: the address of a
    ``cudaStream_t`` the sessions run on (with ``overlap_streams``, the runtime's own).
    ``overlap_streams``: segments run on one compute stream without synchronising at the end
    of each run, ordered against the comm stream by events (off until measured on a GPU).
    ``comm``: how device buffers are communicated: ``host`` (staged through host memory) or
    ``nccl`` (comm/nccl.py; host where cupy or NCCL is missing, with a warning)."""

    use_tf32: bool | None = None
    cudnn_conv_algo_search: str | None = None
    arena_extend_strategy: str | None = None
    gpu_mem_limit: int | None = None
    user_compute_stream: int | None = None
    overlap_streams: bool = False
    comm: str = "host"

    def __post_init__(self) -> None:
        if self.comm not in COMMS:
            raise OptionError(f"CudaOptions comm={self.comm!r}: choose one of {list(COMMS)}")
        for name, allowed in (("cudnn_conv_algo_search", CONV_ALGO_SEARCH),
                              ("arena_extend_strategy", ARENA_EXTEND)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise OptionError(f"CudaOptions {name}={value!r}: choose one of "
                                  f"{list(allowed)}")
        for name in ("gpu_mem_limit", "user_compute_stream"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise OptionError(f"CudaOptions {name}={value!r}: a positive whole number "
                                  f"({'bytes' if name == 'gpu_mem_limit' else 'a cudaStream_t address'})")
        if self.overlap_streams and self.user_compute_stream is None:
            raise OptionError("CudaOptions overlap_streams=True needs user_compute_stream, the "
                              "cudaStream_t the sessions and NCCL share (e.g. "
                              "cupy.cuda.Stream(non_blocking=True).ptr)")
        for name in ("use_tf32", "overlap_streams"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise OptionError(f"CudaOptions {name}={value!r}: True or False")

    def provider_options(self, device_id: int) -> dict[str, str]:
        """The options as onnxruntime's CUDA provider takes them (strings; ``device_id``
        first, then the fields that are set)."""
        out = {"device_id": str(device_id)}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("overlap_streams", "comm"):
                continue
            out[f.name] = str(int(value)) if isinstance(value, bool) else str(value)
            if f.name == "user_compute_stream":
                out["has_user_compute_stream"] = "1"
        return out


def _loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def missing() -> str | None:
    """What the CUDA provider cannot find, in words ("libcublasLt.so.13, libcublas.so.13 (pip
    install nvidia-cublas); ..."), or None when every library it needs is found."""
    absent = [(lib, how) for lib, how in DEPENDENCIES if not _loads(lib)]
    if not absent:
        return None
    by_how: dict[str, list[str]] = {}
    for lib, how in absent:
        by_how.setdefault(how, []).append(lib)
    return "; ".join(f"{', '.join(libs)} ({how})" for how, libs in by_how.items())


def run_options(device: str, options: CudaOptions) -> Any:
    """The run options of a segment: None (onnxruntime synchronises its stream at the end of
    each run: correct first) unless ``overlap_streams`` on ``cuda``, where the run returns
    without that and the comm stream's events order the work
    (``disable_synchronize_execution_providers``)."""
    if device != "cuda" or not options.overlap_streams:
        return None
    import onnxruntime as ort

    opts = ort.RunOptions()
    opts.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return opts
