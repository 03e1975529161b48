"""The GPU check: what the CPU cannot prove, in one script of a few minutes on one GPU.

    python benchmarks/gpu_check.py --all            # or: probe nccl-raw cuda-1rank nccl-2rank speed

Stages (each prints a table and, with ``$OUT`` set, writes ``$OUT/gpu_check_<stage>.json``):

* ``probe``: versions (onnxruntime and its providers, cupy and NCCL, torch, MPI), what the CUDA
  provider is missing, and one Gemm on a CUDA session (its providers, ``use_tf32=0`` taken)
  through IOBinding with a cupy view of its output; on the CPU, the same on a CPU session.
* ``nccl-raw``: cupy's own NCCL AllReduce on 2 ranks of one GPU (``NCCL_HOSTID`` per rank).
* ``cuda-1rank``: 20 steps of the digits CNN and a small GPT-style model on CUDA
  (``use_tf32=False``) against the CPU path, parameters within 1e-4.
* ``nccl-2rank``: the ProcessGroup contract on NcclGroup and HostStagedGroup with cupy, and
  2-rank training (``comm="nccl"``) against one process within 1e-5, pushsum and ps; on the
  CPU the 2-rank training on host memory against one process.
* ``speed``: steps/s of a ResNet-18-sized CNN and a small GPT, ngdist against eager PyTorch on
  the same GPU, and the AllReduce kernel's bus bandwidth against cupy's raw ``allReduce``
  (loopback sockets between two ranks of one GPU: it ran, it is not a performance figure).

Without a CUDA device every stage runs its CPU part or says ``skipped: no CUDA device`` with
the reason, and the script exits 0; a failed check exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORK = Path(tempfile.mkdtemp(prefix="gpu_check_"))  # the ranks' files
STAGES = ("probe", "nccl-raw", "cuda-1rank", "nccl-2rank", "speed")
NCCL_ENV = "NCCL_HOSTID=ngdist-r$PMI_RANK NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo " \
           "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1"


# ------------------------------------------------------------------ helpers
def no_gpu() -> str | None:
    """Why there is no usable CUDA device here, or None."""
    try:
        from ngdist.runtime.sessions import placement_for
        placement_for("cuda")
    except Exception as exc:  # noqa: BLE001 - the reason is the report
        return str(exc)
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no GPU"
    except Exception as exc:  # noqa: BLE001
        return f"cupy: {exc}"
    return None


def ranks(n: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """This script's worker mode on ``n`` ranks, each with its own NCCL host identity."""
    mpiexec = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        mpiexec = "mpiexec"
    wrap = f"export {NCCL_ENV}; exec \"$0\" \"$@\""
    cmd = [mpiexec, "-n", str(n), "sh", "-c", wrap, sys.executable, __file__, "--worker", *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=WORK)
    if proc.returncode != 0:
        raise RuntimeError(f"{n} ranks of {args} exited {proc.returncode}: "
                           f"{(proc.stdout + proc.stderr)[-2000:]}")
    return proc


def table(stage: str, rows: list[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=10)
    print(f"\n== {stage}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def save(stage: str, result: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out, f"gpu_check_{stage}.json").write_text(json.dumps(result, indent=1,
                                                                   default=str))


def tried(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - versions: what is missing is the answer
        return f"unavailable ({type(exc).__name__}: {exc})"[:300]


# ------------------------------------------------------------------ models
def gpt(vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 2, length: int = 16) -> Any:
    import torch
    from torch import nn

    class GPT(nn.Module):
        """Token and position embeddings, causal encoder layers, a next-token head."""

        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
            self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                norm_first=True) for _ in range(layers))
            self.head = nn.Linear(d, vocab)
            self.register_buffer("mask", torch.triu(torch.full((length, length),
                                                               float("-inf")), 1))

        def forward(self, tokens: Any) -> Any:
            h = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
            for block in self.blocks:
                h = block(h, src_mask=self.mask)
            return self.head(h).mean(1)
    torch.manual_seed(0)
    return GPT()


def batches(kind: str, n: int, steps: int) -> list[dict[str, np.ndarray]]:
    if kind == "cnn":
        from ngdist.data import load_digits
        x, y, _, _ = load_digits(images=True)
        return [{"x": x[s * n:(s + 1) * n], "y": y[s * n:(s + 1) * n]} for s in range(steps)]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, 64, (n, 16)).astype(np.int64)
        out.append({"x": tokens, "y": (tokens.sum(1) % 64).astype(np.int64)})
    return out


def trainer(kind: str, device: str = "cpu", **kw: Any) -> Any:
    import ngdist
    from ngdist import zoo
    from ngdist.runtime.cuda import CudaOptions

    opt = ngdist.optim.SGD(lr=0.05, momentum=0.9)
    cuda = CudaOptions(use_tf32=False, comm=kw.pop("comm", "host")) if device == "cuda" else None
    if kind == "cnn":
        return ngdist.compile(zoo.digits_cnn(seed=0), loss="softmax_cross_entropy", labels="y",
                              optimizer=opt, device=device, cuda=cuda, **kw)
    import torch
    return ngdist.compile(gpt(), torch.zeros((2, 16), dtype=torch.int64),
                          loss=torch.nn.CrossEntropyLoss(), input_names=["x"], optimizer=opt,
                          device=device, cuda=cuda, **kw)


def train(kind: str, device: str, steps: int = 20, n: int = 32, part: tuple[int, int] = (0, 1),
          **kw: Any) -> tuple[dict[str, np.ndarray], list[float]]:
    """Parameters and losses after ``steps`` steps; ``part=(r, k)``: this rank's r-th of k
    slices of each global batch of ``n``."""
    tr = trainer(kind, device, **kw)
    losses = []
    r, k = part
    for feed in batches(kind, n, steps):
        local = {key: v[r * n // k:(r + 1) * n // k] for key, v in feed.items()}
        losses.append(float(tr.step(local).loss))
    params = {name: np.array(v) for name, v in tr.parameters().items()}
    tr.close()
    return params, losses


def max_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(a[k] - b[k])) / (np.max(np.abs(b[k])) or 1.0)) for k in b)


# ------------------------------------------------------------------ stages
def probe(gpu: str | None) -> dict[str, Any]:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ngdist.runtime import cuda
    from ngdist.runtime.sessions import CPU, Placement, make_session

    res: dict[str, Any] = {
        "python": sys.version.split()[0], "numpy": np.__version__,
        "onnxruntime": ort.__version__, "available providers": ort.get_available_providers(),
        "cupy": tried(lambda: __import__("cupy").__version__),
        "nccl": tried(lambda: __import__("cupy.cuda.nccl", fromlist=["x"]).get_version()),
        "torch": tried(lambda: f"{__import__('torch').__version__} cuda "
                               f"{__import__('torch').version.cuda}"),
        "MPI": tried(lambda: subprocess.run(
            [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version()"
             ".splitlines()[0])"], capture_output=True, text=True, timeout=60).stdout.strip()),
        "GPUs": tried(lambda: subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                             text=True, timeout=30).stdout.strip()),
        "CUDA provider missing": cuda.missing() or "nothing", "device='cuda'": gpu or "usable"}
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])],
                              [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    place = CPU if gpu else Placement("cuda", 0, cuda.CudaOptions(use_tf32=False))
    sess = make_session(model, place)
    res["session providers"] = sess.get_providers()
    res["use_tf32 taken"] = sess.get_provider_options().get(
        "CUDAExecutionProvider", {}).get("use_tf32", "-")
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", place.value(x))
    binding.bind_output("y", place.ort_device, place.device_id)
    sess.run_with_iobinding(binding)
    out = binding.get_outputs()[0]
    xp = np if gpu else __import__("cupy")
    view = xp.from_dlpack(out)  # the output's own memory
    got = view if xp is np else xp.asnumpy(view)
    res["Gemm via IOBinding, max error"] = float(np.max(np.abs(got - x @ w)))
    res["ok"] = res["Gemm via IOBinding, max error"] < 1e-4 and (
        gpu is not None or res["session providers"][0] == "CUDAExecutionProvider")
    return res


def nccl_raw(gpu: str | None) -> dict[str, Any]:
    if gpu:
        return {"skipped": f"no CUDA device: {gpu}"}
    out = ranks(2, "nccl-raw").stdout
    return {**json.loads(out.strip().splitlines()[-1]), "env": NCCL_ENV}


def cuda_1rank(gpu: str | None) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for kind in ("cnn", "gpt"):
        t0 = time.perf_counter()
        ref, losses = train(kind, "cpu")
        res[f"{kind} cpu: loss first, last"] = (round(losses[0], 4), round(losses[-1], 4))
        if gpu:
            res[f"{kind} cuda"] = f"skipped: no CUDA device: {gpu}"
            continue
        got, gl = train(kind, "cuda")
        res[f"{kind} cuda vs cpu, max rel"] = max_rel(got, ref)
        res[f"{kind} s"] = round(time.perf_counter() - t0, 1)
    res["ok"] = all(v <= 1e-4 for k, v in res.items() if k.endswith("max rel"))
    return res


def nccl_2rank(gpu: str | None) -> dict[str, Any]:
    device = "cpu" if gpu else "cuda"
    res: dict[str, Any] = {"device": device}
    if gpu:
        res["contract on cupy"] = f"skipped: no CUDA device: {gpu}"
    else:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                               "no:cacheprovider", str(ROOT / "tests/comm/test_group_contract.py")],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        res["contract on cupy"] = proc.stdout.strip().splitlines()[-1] if proc.stdout else \
            proc.stderr[-500:]
        res["contract ok"] = proc.returncode == 0
    one, _ = train("cnn", device, n=32)
    ranks(2, "train", device, "allreduce", timeout=300)
    two = dict(np.load(WORK / "gpu_check_train_allreduce.npz"))
    res["2 ranks vs 1 process, max rel"] = max_rel(two, one)
    for strategy in ("pushsum", "ps"):
        ranks(2, "train", device, strategy, timeout=300)
        losses = json.loads((WORK / f"gpu_check_train_{strategy}.json").read_text())
        res[f"{strategy}: loss first, last"] = (round(losses[0], 4), round(losses[-1], 4))
        res[f"{strategy} ok"] = bool(np.isfinite(losses).all() and losses[-1] < losses[0])
    res["ok"] = res["2 ranks vs 1 process, max rel"] <= 1e-5 and res.get("contract ok", True) \
        and res["pushsum ok"] and res["ps ok"]
    return res


def steps_per_s(step: Callable[[], Any], sync: Callable[[], None], n: int = 20) -> float:
    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return n / (time.perf_counter() - t0)


def speed(gpu: str | None) -> dict[str, Any]:
    if gpu:
        return {"skipped": f"no CUDA device: {gpu}"}
    import torch
    import ngdist
    from ngdist.runtime.cuda import CudaOptions

    res: dict[str, Any] = {}
    models = {"resnet18-sized cnn": (tried(lambda: __import__("torchvision").models.resnet18(
        num_classes=10)), (32, 3, 64, 64), 10), "gpt d256 x4": (
        gpt(vocab=512, d=256, layers=4, heads=4, length=128), (16, 128), 512)}
    for name, (module, shape, classes) in models.items():
        if isinstance(module, str):
            res[name] = module
            continue
        ints = len(shape) == 2
        x = torch.randint(0, classes, shape) if ints else torch.randn(shape)
        y = torch.randint(0, classes, shape[:1])
        tr = ngdist.compile(module, x[:2], loss=torch.nn.CrossEntropyLoss(), input_names=["x"],
                            optimizer=ngdist.optim.SGD(lr=0.01), device="cuda",
                            cuda=CudaOptions())
        feed = {"x": x.numpy(), "y": y.numpy()}
        res[f"{name}: ngdist steps/s"] = round(steps_per_s(
            lambda: tr.step(feed, fetch_stats=False), lambda: tr.step(feed)), 2)
        m = module.cuda()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        xc, yc = x.cuda(), y.cuda()

        def eager() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(xc), yc).backward()
            opt.step()
        res[f"{name}: eager torch steps/s"] = round(steps_per_s(eager, torch.cuda.synchronize), 2)
    out = ranks(2, "bandwidth", timeout=240).stdout
    res["AllReduce bus GB/s (ran; loopback sockets)"] = json.loads(out.strip().splitlines()[-1])
    res["ok"] = True
    return res


# ------------------------------------------------------------------ worker modes (per rank)
def worker(mode: str, *args: str) -> None:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if mode == "nccl-raw":
        import cupy
        from cupy.cuda import nccl
        uid = world.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
        cupy.cuda.Device(0).use()
        comm = nccl.NcclCommunicator(2, uid, rank)
        x = cupy.arange(1 << 18, dtype=cupy.float32) * (rank + 1)
        comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cupy.cuda.Stream.null.ptr)
        cupy.cuda.Stream.null.synchronize()
        ok = bool((x == cupy.arange(1 << 18, dtype=cupy.float32) * 3).all())
        if rank == 0:
            print(json.dumps({"nccl version": nccl.get_version(), "allReduce 1 MiB ok": ok,
                              "ok": ok}))
    elif mode == "train":
        device, strategy = args
        kw = {"comm": "nccl"} if device == "cuda" else {}
        if strategy == "allreduce":
            params, _ = train("cnn", device, n=32, part=(rank, 2), **kw)
            if rank == 0:
                np.savez("gpu_check_train_allreduce.npz", **params)
        else:
            _, losses = train("cnn", device, n=32, part=(rank, 2), strategy=strategy, **kw)
            if rank == 0:
                Path(f"gpu_check_train_{strategy}.json").write_text(json.dumps(losses))
    elif mode == "bandwidth":
        bandwidth(world, rank)


def bandwidth(world: Any, rank: int) -> None:
    """Bus bandwidth of NcclGroup's AllReduce and cupy's raw allReduce, 1-256 MiB."""
    import cupy
    from cupy.cuda import nccl
    from ngdist.comm.mpi import MpiGroup
    from ngdist.comm.nccl import NcclGroup

    group = NcclGroup(MpiGroup(120), 0)
    out = {}
    for mib in (1, 16, 256):
        x = cupy.ones(mib << 18, cupy.float32)
        for name, call in (("ngdist", lambda: group.allreduce(x, "bw").wait()), (
                "raw", lambda: (group.comm.allReduce(x.data.ptr, x.data.ptr, x.size,
                                                     nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                                     group.stream.ptr),
                                group.stream.synchronize()))):
            call()
            t0 = time.perf_counter()
            for _ in range(5):
                call()
            dt = (time.perf_counter() - t0) / 5
            out[f"{name} {mib} MiB"] = round(2 * (2 - 1) / 2 * x.nbytes / dt / 1e9, 3)
    if rank == 0:
        print(json.dumps(out))


RUN = {"probe": probe, "nccl-raw": nccl_raw, "cuda-1rank": cuda_1rank,
       "nccl-2rank": nccl_2rank, "speed": speed}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help=f"some of {', '.join(STAGES)}")
    parser.add_argument("--all", action="store_true", help="every stage, in order")
    args = parser.parse_args()
    stages = list(STAGES) if args.all or not args.stages else args.stages
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {list(STAGES)}")
    gpu = no_gpu()
    failed = []
    for stage in stages:
        t0 = time.perf_counter()
        try:
            result = RUN[stage](gpu)
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
            result = {"error": f"{type(exc).__name__}: {exc}"[:3000], "ok": False}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if "skipped" in result:
            print(f"\n== {stage}\n  skipped: {result['skipped']}")
        else:
            table(stage, list(result.items()))
        save(stage, result)
        if result.get("ok") is False:
            failed.append(stage)
    print(f"\nfailed: {failed}" if failed else "\nno check failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
