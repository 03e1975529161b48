"""Model-file fuzzer: mutations of real ngdist model files, run through ngdist's entry points.

Shared by ``tests/fuzz/test_fuzz_models.py`` (a seeded CI run of about 100 cases) and
``benchmarks/fuzz_models.py`` (``--cases N --seed S``). The seed files are the bundled MLP and
CNN (``ngdist.zoo``) written by ngdist itself: forward-only, training model, rewritten
(allreduce, pushsum), and saved after a training step. Each case mutates one of them (bit
flips, truncation, protobuf field tampering, external-data tricks, huge and deep graphs,
special files) and runs, in a worker process with a timeout and a memory limit
(``resource.RLIMIT_AS``):

* ``ngdist inspect FILE`` and ``ngdist rewrite FILE -o OUT`` (the CLI's ``main`` in the
  worker): exit 0, or exit 1 with one ``ngdist: error:`` line;
* ``ngdist.compile(FILE)``: a Trainer, or an ``NgdistError``;
* when the rewrite wrote OUT: ``ngdist.compile(OUT)`` and one training step on it (every file
  ngdist writes, ngdist loads back and runs).

A case is classified by its worst outcome: ``ok``, ``clean`` (a clean error), ``traceback``
(any other exception, or a CLI error that is not one line), ``crash`` (the worker died of a
signal), ``hang`` (past the timeout), ``oom`` (MemoryError or killed past the memory limit).
The worker survives ok/clean/traceback cases and is restarted after the others, so cases run
at in-process speed and are isolated only where a hang or crash happens.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ("ok", "clean", "traceback", "crash", "hang", "oom")
BAD = ("traceback", "crash", "hang", "oom")
SEVERITY = {c: i for i, c in enumerate(CLASSES)}


# --------------------------------------------------------------------------- seed files

def write_seeds(folder: Path) -> dict[str, Path]:
    """The seed model files, written by ngdist into ``folder``."""
    import ngdist
    from ngdist import zoo
    from ngdist.ir.model import save_proto
    from ngdist.passes.pipeline import rewrite

    folder.mkdir(parents=True, exist_ok=True)
    seeds: dict[str, Path] = {}

    def put(name: str, model: onnx.ModelProto) -> None:
        seeds[name] = folder / f"{name}.onnx"
        save_proto(model, seeds[name])

    sgd = ngdist.optim.SGD(lr=0.1, momentum=0.9)
    for name, forward in (("mlp", zoo.mlp((64, 16, 10))), ("cnn", zoo.cnn((4, 4)))):
        put(f"{name}.forward", forward)
        training = ngdist.to_training_model(forward, optimizer=sgd)
        put(f"{name}.training", training)
        put(f"{name}.allreduce", rewrite(training, "allreduce"))
    put("mlp.pushsum", rewrite(ngdist.to_training_model(zoo.mlp((64, 16, 10)),
                                                        optimizer=ngdist.optim.Adam(lr=1e-3)),
                               "pushsum"))
    trainer = ngdist.compile(seeds["mlp.training"])
    trainer.step(example_batch(onnx.load(seeds["mlp.training"])))
    seeds["mlp.saved"] = folder / "mlp.saved.onnx"
    trainer.save(seeds["mlp.saved"])
    return seeds


def example_batch(model: onnx.ModelProto, n: int = 4) -> dict[str, np.ndarray]:
    """A batch for the data inputs of a training model (zeros; labels 0)."""
    if not model.training_info:
        return {}
    alg = model.training_info[0].algorithm
    inits = {t.name for t in alg.initializer} | {t.name for t in model.graph.initializer}
    batch = {}
    for inp in alg.input:
        if inp.name in inits:
            continue
        t = inp.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and 0 < d.dim_value <= 4096 else n
                for d in t.shape.dim]
        batch[inp.name] = np.zeros(dims, helper.tensor_dtype_to_np_dtype(t.elem_type))
    return batch


# --------------------------------------------------------------------------- mutations

@dataclass
class Case:
    index: int
    kind: str
    seed_name: str
    path: str
    forward: bool
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)


Mutation = Callable[[np.random.Generator, onnx.ModelProto, bytes, Path], tuple[object, str]]
NAMED_DTYPES = [TensorProto.STRING, TensorProto.INT4, TensorProto.UINT4, TensorProto.BOOL,
                TensorProto.FLOAT16, TensorProto.INT64, TensorProto.UNDEFINED, 99, -3,
                TensorProto.COMPLEX64, TensorProto.FLOAT8E4M3FN]


def _graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    return [model.graph, *(info.algorithm for info in model.training_info)]


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))] if len(seq) else None


def _all_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for g in _graphs(model) for t in g.initializer]


def m_bitflip(rng, model, data, folder):
    buf = bytearray(data)
    flips = int(rng.integers(1, 9))
    for _ in range(flips):
        pos = int(rng.integers(len(buf)))
        buf[pos] ^= 1 << int(rng.integers(8))
    return bytes(buf), f"{flips} bits"


def m_truncate(rng, model, data, folder):
    cut = int(rng.integers(1, len(data)))
    return data[:cut], f"{cut}/{len(data)} bytes"


def m_dtype(rng, model, data, folder):
    t = _pick(rng, _all_tensors(model))
    t.data_type = int(_pick(rng, NAMED_DTYPES))
    return model, f"{t.name} dtype {t.data_type}"


def m_dims(rng, model, data, folder):
    t = _pick(rng, _all_tensors(model))
    choice = int(rng.integers(5))
    if choice == 0 and t.dims:
        t.dims[int(rng.integers(len(t.dims)))] = -int(rng.integers(1, 5))
    elif choice == 1:
        t.dims.append(int(rng.integers(2, 5)))
    elif choice == 2 and t.dims:
        t.dims[0] = 10 ** 12
    elif choice == 3:
        del t.dims[:]
    else:
        t.dims.extend([2 ** 31, 2 ** 31])
    return model, f"{t.name} dims {list(t.dims)}"


def m_value_dims(rng, model, data, folder):
    """Negative or enormous dims on graph inputs/outputs (the declared types)."""
    g = _pick(rng, _graphs(model))
    values = [*g.input, *g.output]
    v = _pick(rng, values)
    dims = v.type.tensor_type.shape.dim
    if dims:
        dims[int(rng.integers(len(dims)))].dim_value = int(_pick(rng, [-1, -7, 0, 10 ** 13]))
    v.type.tensor_type.elem_type = int(_pick(rng, [v.type.tensor_type.elem_type, 8, 22, 0]))
    return model, f"{v.name}"


def _names(model: onnx.ModelProto) -> list[str]:
    names = set()
    for g in _graphs(model):
        names |= {t.name for t in g.initializer} | {v.name for v in [*g.input, *g.output]}
        names |= {o for n in g.node for o in [*n.input, *n.output] if o}
    return sorted(names)


def m_rename(rng, model, data, folder):
    old = _pick(rng, _names(model))
    new = _pick(rng, ["", " ", "ngdist.step", "x", "a" * 5000, "ünï\u202ecode", "y", old + ".new"])
    for g in _graphs(model):
        for t in g.initializer:
            if t.name == old and rng.random() < 0.7:
                t.name = new
        for v in [*g.input, *g.output]:
            if v.name == old and rng.random() < 0.7:
                v.name = new
        for n in g.node:
            for seq in (n.input, n.output):
                for i, name in enumerate(seq):
                    if name == old and rng.random() < 0.7:
                        seq[i] = new
    for info in model.training_info:
        for kv in info.update_binding:
            if old in (kv.key, kv.value) and rng.random() < 0.5:
                kv.key = new if kv.key == old else kv.key
                kv.value = new if kv.value == old else kv.value
    return model, f"{old!r} -> {new[:20]!r}"


def m_non_utf8(rng, model, data, folder):
    """A name's bytes replaced in place by bytes that are not UTF-8 (same length)."""
    name = _pick(rng, [n for n in _names(model) if len(n) >= 2]).encode()
    hits = [i for i in range(len(data)) if data.startswith(name, i)]
    buf = bytearray(data)
    for pos in hits[:int(rng.integers(1, len(hits) + 1))]:
        buf[pos:pos + len(name)] = b"\xff\xfe" * (len(name) // 2) + b"\xc3" * (len(name) % 2)
    return bytes(buf), name.decode()


def m_remove(rng, model, data, folder):
    g = _pick(rng, _graphs(model))
    what = _pick(rng, ["output", "input", "initializer", "node", "binding", "all_outputs"])
    if what == "binding" and model.training_info and model.training_info[0].update_binding:
        seq = model.training_info[0].update_binding
    elif what == "all_outputs":
        del g.output[:]
        return model, what
    else:
        seq = {"output": g.output, "input": g.input, "initializer": g.initializer,
               "node": g.node}.get(what, g.node)
    if len(seq):
        del seq[int(rng.integers(len(seq)))]
    return model, what


def m_training_info(rng, model, data, folder):
    what = _pick(rng, ["empty", "empty_algorithm", "two", "initialization", "no_binding"])
    if what == "empty" or not model.training_info:
        del model.training_info[:]
        model.training_info.add()
    elif what == "empty_algorithm":
        model.training_info[0].algorithm.Clear()
    elif what == "two":
        model.training_info.add().CopyFrom(model.training_info[0])
    elif what == "initialization":
        init = model.training_info[0].initialization
        init.node.add().CopyFrom(helper.make_node("Identity", ["ngdist.step"], ["z"]))
        kv = model.training_info[0].initialization_binding.add()
        kv.key, kv.value = "ngdist.step", "z"
    else:
        del model.training_info[0].update_binding[:]
    return model, what


BAD_JSON = ['{"fc0.weight": "param"', "[]", '{"fc0.weight": 3}', '{"nope": "param"}',
            '{"fc0.weight": "weights"}', "null", '"param"', '{"ngdist.step": "param"}',
            '{"x": "data", "y": "banana"}', "1e999", "[" * 100_000]


def m_metadata(rng, model, data, folder):
    key = _pick(rng, ["ngdist.roles", "ngdist.loss", "ngdist.roles"])
    value = _pick(rng, BAD_JSON) if key == "ngdist.roles" else _pick(rng, ["", "nope", "x"])
    props = {p.key: p.value for p in model.metadata_props}
    props[key] = value
    helper.set_model_props(model, props)
    return model, f"{key}={value[:40]!r}"


def m_binding(rng, model, data, folder):
    if not model.training_info or not model.training_info[0].update_binding:
        return m_training_info(rng, model, data, folder)
    kv = _pick(rng, model.training_info[0].update_binding)
    if rng.random() < 0.5:
        kv.value = "missing.output"
    else:
        kv.key = "missing.initializer"
    return model, f"{kv.key} -> {kv.value}"


def m_param_type(rng, model, data, folder):
    """A parameter turned into a STRING or 4-bit tensor of the same shape."""
    t = _pick(rng, list(model.graph.initializer))
    count = int(np.prod(t.dims)) if t.dims else 1
    name, dims = t.name, list(t.dims)
    if rng.random() < 0.5:
        new = helper.make_tensor(name, TensorProto.STRING, dims, [b"w"] * count)
    else:
        kind = _pick(rng, [TensorProto.INT4, TensorProto.UINT4])
        new = onnx.TensorProto(name=name, data_type=kind, dims=dims,
                               raw_data=bytes((count + 1) // 2))
    t.CopyFrom(new)
    return model, f"{name} -> {new.data_type}"


def m_missing_value(rng, model, data, folder):
    g = _pick(rng, _graphs(model))
    node = _pick(rng, [n for n in g.node if n.input])
    if node is None:
        return model, "no node"
    node.input[int(rng.integers(len(node.input)))] = "not.defined.anywhere"
    return model, node.name


def _save_external(model: onnx.ModelProto, path: Path, location: str) -> None:
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
              location=location, size_threshold=0)


def m_external(rng, model, data, folder):
    trick = _pick(rng, ["traversal", "absolute", "symlink_file", "symlink_dir", "missing",
                        "short", "offset", "length", "negative", "fifo", "dir", "ok", "subdir"])
    path = folder / "model.onnx"
    if trick == "subdir":
        (folder / "sub").mkdir()
        _save_external(model, path, "sub/weights.bin")
        return path, trick
    _save_external(model, path, "weights.bin")
    data_file = folder / "weights.bin"
    ext = onnx.load(path, load_external_data=False)
    tensors = [t for t in ext.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    target = _pick(rng, tensors)

    def set_field(key: str, value: str) -> None:
        for e in target.external_data:
            if e.key == key:
                e.value = value
                return
        target.external_data.add(key=key, value=value)

    outside = folder.parent / f"outside-{folder.name}.bin"
    outside.write_bytes(data_file.read_bytes())
    if trick == "traversal":
        set_field("location", f"../{outside.name}")
    elif trick == "absolute":
        set_field("location", str(outside))
    elif trick == "symlink_file":
        os.symlink(outside, folder / "link.bin")
        set_field("location", "link.bin")
    elif trick == "symlink_dir":
        os.symlink(folder.parent, folder / "up")
        set_field("location", f"up/{outside.name}")
    elif trick == "missing":
        data_file.unlink()
    elif trick == "short":
        data_file.write_bytes(data_file.read_bytes()[:int(rng.integers(data_file.stat().st_size))])
    elif trick == "offset":
        set_field("offset", str(10 ** 9))
    elif trick == "length":
        set_field("length", str(int(rng.integers(1, 10 ** 6))))
    elif trick == "negative":
        set_field(_pick(rng, ["offset", "length"]), "-8")
    elif trick == "fifo":
        data_file.unlink()
        os.mkfifo(data_file)
    elif trick == "dir":
        data_file.unlink()
        data_file.mkdir()
    onnx.save(ext, path)
    return path, trick


def m_huge_chain(rng, model, data, folder, light=False):
    """A chain of unary nodes between the logits and the graph output: 10^4 or 2*10^4
    Identity nodes (the loaders, checkers and clean-up at scale), or 500 or 1000 Relu/Neg
    nodes that the autodiff differentiates (300 or 600 when ``light``): onnxruntime's session
    set-up grows about quadratically with them (docs/ARCHITECTURE.md)."""
    g = model.graph
    op = _pick(rng, ["Identity", "Relu", "Neg"])
    lengths = [10_000, 20_000] if op == "Identity" else [300, 600] if light else [500, 1000]
    length = int(_pick(rng, lengths))
    out = g.output[0].name
    producer = next(n for n in g.node if out in n.output)
    producer.output[list(producer.output).index(out)] = "chain.0"
    for i in range(length):
        g.node.append(helper.make_node(op, [f"chain.{i}"],
                                       [out if i == length - 1 else f"chain.{i + 1}"]))
    return model, f"{length} x {op}"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def m_deep_nesting(rng, model, data, folder):
    """The main graph gets an If node whose then-branch holds an If ... ``depth`` levels deep,
    written directly as protobuf bytes (onnx's helpers cannot build what protobuf refuses to
    parse): a repeated field appended to a serialized message is merged into it."""
    depth = int(_pick(rng, [20, 60, 200, 5000]))
    out_vi = helper.make_tensor_value_info("o", TensorProto.FLOAT, None).SerializeToString()
    leaf = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "leaf", [],
                             [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    graph = leaf.SerializeToString()
    for level in range(depth):
        output = b"nested" if level == depth - 1 else b"o"
        attrs = b"".join(
            _field(5, _field(1, name) + _field(6, branch) + _varint(20 << 3) + _varint(5))
            for name, branch in ((b"then_branch", graph),
                                 (b"else_branch", leaf.SerializeToString())))
        node = _field(1, b"c") + _field(2, output) + _field(4, b"If") + attrs
        graph = _field(1, node) + _field(2, b"g") + _field(12, out_vi)
    condition = helper.make_node("Constant", [], ["c"], value=helper.make_tensor(
        "c", TensorProto.BOOL, [], [True])).SerializeToString()
    # field 7 of ModelProto is the graph, field 1 of GraphProto its nodes
    return data + _field(7, _field(1, condition) + _field(1, node)), f"depth {depth}"


def m_special(rng, model, data, folder):
    what = _pick(rng, ["fifo", "dir", "dev_zero", "too_big", "empty", "symlink_loop"])
    path = folder / "special.onnx"
    env = {}
    if what == "fifo":
        os.mkfifo(path)
    elif what == "dir":
        path.mkdir()
    elif what == "dev_zero":
        os.symlink("/dev/zero", path)
    elif what == "too_big":
        path.write_bytes(data)
        env["NGDIST_MAX_MODEL_BYTES"] = str(len(data) - 1)
    elif what == "symlink_loop":
        os.symlink(path, path)
    else:
        path.write_bytes(b"")
    return (path, env), what


MUTATIONS: dict[str, Mutation] = {
    "bitflip": m_bitflip, "truncate": m_truncate, "dtype": m_dtype, "dims": m_dims,
    "value_dims": m_value_dims, "rename": m_rename, "non_utf8": m_non_utf8, "remove": m_remove,
    "training_info": m_training_info, "metadata": m_metadata, "binding": m_binding,
    "param_type": m_param_type, "missing_value": m_missing_value, "external": m_external,
    "huge_chain": m_huge_chain, "deep_nesting": m_deep_nesting, "special": m_special,
}


def make_case(index: int, seed: int, seeds: dict[str, Path], folder: Path,
              kinds: list[str] | None = None, light: bool = False) -> Case:
    """Case ``index`` of run ``seed``: its kind round-robin over ``kinds`` (so a small run
    covers every kind), the seed file and the mutation drawn from a generator of its own."""
    kinds = kinds or list(MUTATIONS)
    rng = np.random.default_rng([seed, index])
    kind = kinds[index % len(kinds)]
    seed_name = _pick(rng, sorted(seeds))
    data = seeds[seed_name].read_bytes()
    model = onnx.load_from_string(data)
    case_dir = folder / f"case{index:05d}"
    case_dir.mkdir(parents=True)
    mutate = MUTATIONS[kind]
    result, note = (m_huge_chain(rng, model, data, case_dir, light) if mutate is m_huge_chain
                    else mutate(rng, model, data, case_dir))
    env: dict[str, str] = {}
    if isinstance(result, tuple):
        result, env = result
    if isinstance(result, Path):
        path = result
    else:
        path = case_dir / "model.onnx"
        path.write_bytes(result if isinstance(result, bytes) else result.SerializeToString())
    return Case(index, kind, seed_name, str(path), seed_name.endswith(".forward"), note, env)


# --------------------------------------------------------------------------- the worker

def _cli(argv: list[str]) -> tuple[str, str]:
    from ngdist.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except MemoryError:
        return "oom", "MemoryError"
    except BaseException as exc:  # noqa: BLE001 - every escape is what the fuzzer looks for
        return "traceback", _describe(exc)
    lines = err.getvalue().splitlines()
    errors = [ln for ln in lines if ln.startswith("ngdist: error: ")]
    if rc == 0:
        return "ok", ""
    if rc == 1 and len(errors) == 1 and errors[0] == lines[-1]:
        return "clean", errors[0]
    return "traceback", f"exit {rc}: {err.getvalue()[-500:]}"


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" \
        if frames else ""
    return f"{type(exc).__name__}: {str(exc)[:300]}{where}"


def _api(fn: Callable[[], object]) -> tuple[str, str]:
    from ngdist.errors import NgdistError

    try:
        fn()
    except MemoryError:
        return "oom", "MemoryError"
    except NgdistError as exc:
        return "clean", f"{type(exc).__name__}: {str(exc)[:200]}"
    except BaseException as exc:  # noqa: BLE001
        return "traceback", _describe(exc)
    return "ok", ""


def _train_step(path: str) -> None:
    """``ngdist.compile(path)`` (with an optimizer for a forward-only model) and one training
    step on a batch of zeros."""
    import ngdist
    from ngdist.ir.model import load_proto

    given = {} if load_proto(path).training_info else {"optimizer": ngdist.optim.SGD(lr=0.01)}
    trainer = ngdist.compile(path, **given)
    try:
        trainer.step(example_batch(ngdist.to_training_model(load_proto(path), **given)))
    finally:
        trainer.close()


def _raise() -> None:
    raise ValueError("probe")


_PROBES: dict[str, Callable[[], object]] = {
    "raise": _raise, "segv": lambda: os.kill(os.getpid(), signal.SIGSEGV),
    "sleep": lambda: time.sleep(3600), "alloc": lambda: bytearray(8 << 30)}


def run_case(case: dict) -> dict:
    """Runs one case's entry points in this process: {entry: [class, detail]}."""
    saved = {k: os.environ.get(k) for k in case["env"]}
    os.environ.update(case["env"])
    path, out = case["path"], str(Path(case["path"]).parent / "rewritten.onnx")
    extra = ["--optimizer", "sgd:lr=0.1"] if case["forward"] else []
    results = {}
    try:
        probe = os.environ.get("NGDIST_FUZZ_PROBE")
        if probe:  # the classifier's own check: each bad outcome, on purpose
            return {"probe": list(_api(lambda: _PROBES[probe]()))}
        results["inspect"] = _cli(["inspect", path])
        results["rewrite"] = _cli(["rewrite", path, "-o", out, *extra])
        results["compile"] = _api(lambda: _train_step(path))
        if results["rewrite"][0] == "ok":
            results["reload"] = _api(lambda: _train_step(out))
            if results["reload"][0] == "clean" and results["compile"][0] == "ok":
                # what ngdist wrote from a model it runs, ngdist loads back and runs
                results["reload"] = ("traceback", "written file refused: " + results["reload"][1])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {k: list(v) for k, v in results.items()}


def worker_main() -> None:
    """Reads one JSON case a line on stdin, answers one JSON line on the protocol descriptor
    (the original stdout; fd 1 goes to /dev/null so that nothing else can corrupt it)."""
    proto = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    import logging
    logging.disable(logging.CRITICAL)
    import ngdist  # noqa: F401 - the import cost paid once, before the first case
    proto.write("ready\n")
    proto.flush()
    for line in sys.stdin:
        proto.write(json.dumps(run_case(json.loads(line))) + "\n")
        proto.flush()


class Worker:
    """A worker process with a memory limit; restarted after a crash, hang or OOM."""

    def __init__(self, memory_bytes: int, timeout: float):
        self.memory_bytes, self.timeout = memory_bytes, timeout
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        limit = self.memory_bytes

        def limit_memory() -> None:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{Path(__file__).parent}",
               "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import modelfuzz; modelfuzz.worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=env, preexec_fn=limit_memory, start_new_session=True)
        if self._read(120) != "ready":
            raise RuntimeError("the fuzz worker did not start")

    def _read(self, timeout: float) -> str | None:
        """The next line, "" when the worker closed its end (it died), None after timeout."""
        assert self.proc and self.proc.stdout
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        return self.proc.stdout.readline().strip()

    def run(self, case: Case) -> tuple[str, dict]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc and self.proc.stdin
        payload = {"path": case.path, "forward": case.forward, "env": case.env}
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        line = self._read(self.timeout)
        if line:
            results = json.loads(line)
            worst = max((r[0] for r in results.values()), key=SEVERITY.__getitem__)
            return worst, results
        if line is None:  # no answer in time: a hang
            self.stop()
            return "hang", {"timeout": ["hang", f"no result within {self.timeout} s"]}
        code = self.proc.wait()
        self.proc = None
        if code == -signal.SIGKILL:
            return "oom", {"worker": ["oom", "killed (SIGKILL), past the memory limit"]}
        return "crash", {"worker": ["crash", f"exit {code} ({_signal_name(code)})"]}

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name if code < 0 else "no signal"
    except ValueError:
        return f"signal {-code}"


@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    failures: list[tuple[Case, str, dict]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, case: Case, cls: str, results: dict) -> None:
        self.counts[cls] += 1
        self.by_kind.setdefault(case.kind, Counter())[cls] += 1
        if cls in BAD:
            self.failures.append((case, cls, results))

    def table(self) -> str:
        head = f"{'kind':16s}" + "".join(f"{c:>10s}" for c in CLASSES)
        rows = [head] + [f"{k:16s}" + "".join(f"{self.by_kind[k][c]:>10d}" for c in CLASSES)
                         for k in sorted(self.by_kind)]
        rows.append(f"{'total':16s}" + "".join(f"{self.counts[c]:>10d}" for c in CLASSES))
        return "\n".join(rows)

    def failure_lines(self, limit: int = 20) -> list[str]:
        out = []
        for case, cls, results in self.failures[:limit]:
            bad = {k: v[1] for k, v in results.items() if v[0] in BAD}
            out.append(f"case {case.index} {case.kind} ({case.seed_name}, {case.note}): "
                       f"{cls}: {bad}")
        return out


def fuzz(cases: int, seed: int, *, folder: Path | None = None, timeout: float = 120.0,
         memory_bytes: int = 4 << 30, kinds: list[str] | None = None, light: bool = False,
         progress: Callable[[int], None] | None = None) -> Report:
    """Generates and runs ``cases`` cases of run ``seed``; the report counts their classes."""
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ngfuzz-")))
        seeds = write_seeds(folder / "seeds")
        worker = Worker(memory_bytes, timeout)
        stack.callback(worker.stop)
        report = Report()
        for i in range(cases):
            case = make_case(i, seed, seeds, folder / "cases", kinds, light)
            cls, results = worker.run(case)
            report.add(case, cls, results)
            if progress:
                progress(i)
    report.seconds = time.perf_counter() - start
    return report
