"""A CUDA placement is checked: the CUDA provider's options are typed and mapped one to one,
and a machine where the provider cannot load (no GPU, no CUDA libraries: this one, CI) makes
``device="cuda"`` fail at once, naming each missing library and the package that provides it.
The oracle for what is missing is ``ldd`` on onnxruntime's provider library."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import onnxruntime as ort
import pytest

import ngdist
from ngdist import zoo
from ngdist.errors import NgdistError, OptionError
from ngdist.runtime import cuda
from ngdist.runtime.cuda import CudaOptions
from ngdist.runtime.sessions import Placement, make_session, placement_for
from test_sessions import cuda_usable, tiny_model

PROVIDER = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
NO_CUDA = pytest.mark.skipif(cuda_usable(), reason="onnxruntime can use a GPU here")


def test_provider_options_map_one_to_one():
    opts = CudaOptions(use_tf32=False, cudnn_conv_algo_search="HEURISTIC",
                       arena_extend_strategy="kSameAsRequested", gpu_mem_limit=1 << 30,
                       user_compute_stream=0x7F00)
    assert opts.provider_options(2) == {
        "device_id": "2", "use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC",
        "arena_extend_strategy": "kSameAsRequested", "gpu_mem_limit": str(1 << 30),
        "user_compute_stream": str(0x7F00), "has_user_compute_stream": "1"}
    assert CudaOptions(use_tf32=True).provider_options(0) == {"device_id": "0", "use_tf32": "1"}
    assert CudaOptions().provider_options(1) == {"device_id": "1"}  # onnxruntime's defaults
    assert Placement("cuda", 2, opts).providers == [
        ("CUDAExecutionProvider", opts.provider_options(2)), "CPUExecutionProvider"]


@pytest.mark.parametrize("kwargs, message", [
    ({"cudnn_conv_algo_search": "FAST"},
     "CudaOptions cudnn_conv_algo_search='FAST': choose one of ['EXHAUSTIVE', 'HEURISTIC', "
     "'DEFAULT']"),
    ({"arena_extend_strategy": "grow"},
     "CudaOptions arena_extend_strategy='grow': choose one of ['kNextPowerOfTwo', "
     "'kSameAsRequested']"),
    ({"gpu_mem_limit": 0}, "CudaOptions gpu_mem_limit=0: a positive whole number (bytes)"),
    ({"user_compute_stream": True},
     "CudaOptions user_compute_stream=True: a positive whole number (a cudaStream_t address)"),
    ({"use_tf32": 0}, "CudaOptions use_tf32=0: True or False"),
    ({"comm": "gloo"}, "CudaOptions comm='gloo': choose one of ['host', 'nccl']"),
    ({"overlap_streams": True},
     "CudaOptions overlap_streams=True needs user_compute_stream, the cudaStream_t the "
     "sessions and NCCL share (e.g. cupy.cuda.Stream(non_blocking=True).ptr)"),
])
def test_bad_provider_options(kwargs, message):
    with pytest.raises(OptionError) as info:
        CudaOptions(**kwargs)
    assert str(info.value) == message


def test_compile_takes_cuda_options_typed():
    with pytest.raises(OptionError, match="option 'cuda' of ngdist.compile takes"):
        ngdist.compile(zoo.mlp((8, 4, 3), seed=0), cuda={"use_tf32": False},
                       optimizer="sgd:lr=0.01")


def _missing_by_ldd() -> str:
    """What is missing, by ``ldd`` on the provider library (its direct dependencies) and a
    dlopen of cuDNN (loaded at run time), in the words of the error message."""
    out = subprocess.run(["ldd", PROVIDER], capture_output=True, text=True, check=True).stdout
    absent = [line.split()[0] for line in out.splitlines() if "not found" in line]
    if not any(line.startswith("libcudnn") for line in absent) and not cuda._loads("libcudnn.so.9"):
        absent.append("libcudnn.so.9")
    how = dict(cuda.DEPENDENCIES)
    groups: dict[str, list[str]] = {}
    for lib in absent:
        groups.setdefault(how[lib], []).append(lib)
    return "; ".join(f"{', '.join(libs)} ({h})" for h, libs in groups.items())


@NO_CUDA
@pytest.mark.skipif(shutil.which("ldd") is None or not os.path.exists(PROVIDER),
                    reason="needs ldd and onnxruntime-gpu's CUDA provider library")
def test_cuda_here_fails_at_once_naming_what_is_missing():
    expected = _missing_by_ldd()
    assert "libcublasLt.so.13" in expected or "libcuda.so.1" in expected  # CI: no GPU stack
    assert cuda.missing() == expected
    with pytest.raises(NgdistError) as info:
        placement_for("cuda")
    assert str(info.value) == (
        f"device='cuda': onnxruntime's CUDA provider cannot load, missing {expected}; use "
        "device='cpu' (or 'auto' to pick CUDA only when it is usable)")
    assert placement_for("auto") == Placement("cpu")
    with pytest.raises(NgdistError) as info:
        ngdist.compile(zoo.mlp((8, 4, 3), seed=0), device="cuda",
                       cuda=CudaOptions(use_tf32=False), optimizer="sgd:lr=0.01")
    assert str(info.value).startswith("device='cuda': onnxruntime's CUDA provider cannot load")


@NO_CUDA
def test_a_session_that_falls_back_to_the_cpu_is_refused():
    """onnxruntime builds a CPU session when the CUDA provider cannot load; make_session
    says so instead of handing it out."""
    with pytest.raises(NgdistError) as info:
        make_session(tiny_model(), Placement("cuda", 0, CudaOptions(use_tf32=False)))
    assert str(info.value) == (
        "the session asked for CUDAExecutionProvider but took CPUExecutionProvider: missing "
        f"{cuda.missing()}; use device='cpu'")


def test_the_check_names_the_provider_it_asked_for(monkeypatch):
    """A CPU placement's session takes the CPU provider: no error; the check compares the
    first provider asked for with the session's first."""
    sess = make_session(tiny_model())
    assert sess.get_providers()[0] == "CPUExecutionProvider"
    monkeypatch.setattr(cuda, "DEPENDENCIES", (("libngdist-absent.so.1", "pip install x"),))
    assert cuda.missing() == "libngdist-absent.so.1 (pip install x)"
    x = np.ones((1, 3), np.float32)
    np.testing.assert_array_equal(sess.run(["y"], {"x": x})[0], x * 2 + 1)


def test_overlap_turns_off_the_end_of_run_synchronise_only_on_cuda():
    assert cuda.run_options("cuda", CudaOptions()) is None  # correct first: onnxruntime syncs
    assert cuda.run_options("cpu", CudaOptions(overlap_streams=True, user_compute_stream=7)) \
        is None
    opts = cuda.run_options("cuda", CudaOptions(overlap_streams=True, user_compute_stream=7))
    assert opts.get_run_config_entry("disable_synchronize_execution_providers") == "1"
