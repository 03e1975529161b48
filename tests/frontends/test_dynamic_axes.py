"""Models with symbolic sizes train end to end and match torch autograd.

ONNX files exported by ``torch.onnx.export`` with dynamic axes (the TorchScript exporter with
``dynamic_axes``, the dynamo exporter with ``dynamic_shapes``) go through
``ngdist.compile("file.onnx", loss=..., labels=...)``; modules whose forward builds
batch-dependent views (``x.view(b, g, c // g, h, w)``, ``x.view(b, -1)``) go through
``ngdist.compile(module, ...)``. For each: the loss and every parameter gradient equal torch
autograd (float64 reference, ngdist in float32, max relative error <= 1e-4) at two batch sizes,
and three SGD steps through one compiled trainer, fed the two batch sizes in turn, leave the
same parameters as torch's SGD (also on 2 ranks under mpiexec for the encoder file).
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

import torch  # noqa: E402
nn = torch.nn

import onnx  # noqa: E402

import ngdist  # noqa: E402
from ngdist.frontends import torch as tfront  # noqa: E402
from step_probe import gradient_errors, max_rel_err, run_step, torch_step  # noqa: E402

TOL = 1e-4
LR = 0.1
BATCHES = (5, 3)  # two batch sizes through the same trainer


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ConvPool1d(nn.Module):
    """Conv1d + MaxPool1d + AvgPool1d; the head averages over the length, so the length may
    be symbolic too (the Conv and pooling gradients then read it at run time)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.pool1 = nn.Conv1d(3, 8, 3, padding=1), nn.MaxPool1d(2)
        self.conv2, self.pool2 = nn.Conv1d(8, 8, 3, stride=2, padding=1), nn.AvgPool1d(2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.pool1(torch.relu(self.conv1(x)))
        x = self.pool2(torch.relu(self.conv2(x)))
        return self.fc(x.mean(-1))


class Encoder(nn.Module):
    """nn.Embedding + one nn.TransformerEncoderLayer (multi-head attention) + a linear head."""

    def __init__(self, vocab: int = 20, d: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.layer(self.emb(x)).mean(1))


class ChannelShuffle(nn.Module):
    """ShuffleNet's channel shuffle between two convolutions: x.view(b, g, c // g, h, w)."""

    def __init__(self, groups: int = 2) -> None:
        super().__init__()
        self.groups = groups
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=groups)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        b, c, h, w = x.size()
        x = x.view(b, self.groups, c // self.groups, h, w).transpose(1, 2).contiguous()
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x.view(b, -1, h, w))), 2)
        return self.fc(x.view(b, -1))


class FlattenView(nn.Module):
    """x.view(x.size(0), -1) between a convolution and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.fc(x.view(x.size(0), -1))


def _batch(kind: str, n: int, seed: int, length: int = 12):
    rng = np.random.default_rng(seed)
    if kind == "tokens":
        x = rng.integers(0, 20, (n, 6)).astype(np.int64)
        return x, (x.sum(1) % 3).astype(np.int64)
    if kind == "signal":
        return rng.standard_normal((n, 3, length)).astype(np.float32), rng.integers(0, 4, n)
    return rng.standard_normal((n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, n)


def _export(module: nn.Module, example: np.ndarray, path: str, exporter: str,
            length: bool) -> None:
    """The file a user exports: the batch axis symbolic (and the length, ``length=True``)."""
    args = (torch.from_numpy(example),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            axes = {0: "batch", 2: "length"} if length else {0: "batch"}
            torch.onnx.export(module, args, path, dynamo=False, input_names=["x"],
                              output_names=["logits"], opset_version=18,
                              do_constant_folding=False,
                              dynamic_axes={"x": axes, "logits": {0: "batch"}})
        else:
            dims = {0: torch.export.Dim("batch", min=2)}
            if length:
                dims[2] = torch.export.Dim("length", min=4, max=64)
            program = torch.onnx.export(module, args, dynamo=True, input_names=["x"],
                                        output_names=["logits"], opset_version=18,
                                        dynamic_shapes=(dims,), verbose=False)
            program.save(path, external_data=False)  # one self-contained file
    model = onnx.load(path)
    dims0 = model.graph.input[0].type.tensor_type.shape.dim
    assert dims0[0].dim_param, "the exported batch axis is symbolic"
    if length:
        assert dims0[2].dim_param, "the exported length axis is symbolic"


def _sgd_reference(module: nn.Module, batches) -> dict[str, np.ndarray]:
    """Parameters after one torch SGD step per batch, in float64."""
    ref = copy.deepcopy(module).double().train()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        xt = torch.from_numpy(x if x.dtype.kind != "f" else x.astype(np.float64))
        nn.functional.cross_entropy(ref(xt), torch.from_numpy(np.asarray(y))).backward()
        opt.step()
    return {n: p.detach().numpy() for n, p in ref.named_parameters()}


FILE_MODELS = {"conv_pool_1d": (ConvPool1d, "signal"), "encoder": (Encoder, "tokens")}
# torch.export (the dynamo exporter) specializes the length of ConvPool1d to the example's,
# so only the TorchScript export keeps it symbolic
FILE_CASES = [("conv_pool_1d", "torchscript", False), ("conv_pool_1d", "torchscript", True),
              ("conv_pool_1d", "dynamo", False), ("encoder", "torchscript", False),
              ("encoder", "dynamo", False)]


def _distinct_parameters(module: nn.Module) -> None:
    """Random parameters: exporters merge initializers of equal value (LayerNorm biases are
    all zeros), which would tie parameters that torch trains apart."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


def _file_names(path: str, module: nn.Module) -> dict[str, tuple[str, bool]]:
    """torch parameter -> (its initializer in the file, stored transposed): the dynamo
    exporter folds the transpose of a Linear's weight into a new initializer (``val_88``)."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    names = {}
    for p, value in module.named_parameters():
        v = value.detach().numpy()
        if p in inits:
            names[p] = (p, False)
        else:
            hits = [n for n, a in inits.items() if v.ndim == 2 and a.shape == v.T.shape
                    and np.array_equal(a, v.T)]
            assert len(hits) == 1, f"parameter {p} is not in the file"
            names[p] = (hits[0], True)
    return names


@pytest.mark.parametrize("name,exporter,length", FILE_CASES,
                         ids=[f"{n}-{e}{'-length' if s else ''}" for n, e, s in FILE_CASES])
def test_exported_file_with_dynamic_axes_trains_like_torch(tmp_path, name, exporter, length):
    cls, kind = FILE_MODELS[name]
    torch.manual_seed(0)
    module = cls()
    _distinct_parameters(module)
    path = str(tmp_path / f"{name}.onnx")
    _export(module, _batch(kind, 2, 99)[0], path, exporter, length)
    names = _file_names(path, module)
    lengths = (12, 9) if length else (12, 12)  # a second length the export never saw
    batches = [_batch(kind, n, seed, ln) for seed, (n, ln) in enumerate(zip(BATCHES, lengths))]

    model = ngdist.to_training_model(path, loss="softmax_cross_entropy", labels="y",
                                     optimizer="sgd:lr=0.01")
    for x, y in batches:
        got = run_step(model, {"x": x, "y": y})
        loss, grads, _ = torch_step(module, x, y, nn.CrossEntropyLoss(), float64=True)
        assert abs(float(got["loss"]) - loss) <= TOL * abs(loss), (x.shape, got["loss"], loss)
        assert set(grads) == set(names)
        mine = {f"{p}.grad": got[f"{o}.grad"].T if t else got[f"{o}.grad"]
                for p, (o, t) in names.items()}
        errors = gradient_errors(mine, grads)
        assert max(errors.values()) <= TOL, (x.shape, errors)

    trainer = ngdist.compile(path, loss="softmax_cross_entropy", labels="y",
                             optimizer=ngdist.optim.SGD(lr=LR))
    steps = [batches[0], batches[1], batches[0]]
    for x, y in steps:
        trainer.step({"x": x, "y": y})
    mine, theirs = trainer.state_dict(), _sgd_reference(module, steps)
    for p, (o, t) in names.items():
        assert max_rel_err(mine[o].T if t else mine[o], theirs[p]) <= TOL, p


MODULES = {"channel_shuffle": ChannelShuffle, "flatten_view": FlattenView}


@pytest.mark.parametrize("name", list(MODULES))
def test_module_with_batch_dependent_views_trains_like_torch(name):
    torch.manual_seed(0)
    module = MODULES[name]()
    batches = [_batch("images", n, seed) for seed, n in enumerate(BATCHES)]
    loss_fn = nn.CrossEntropyLoss()
    model, exp = tfront.training_model(module, torch.from_numpy(batches[0][0][:2]),
                                       loss=loss_fn, optimizer="sgd:lr=0.01")
    targets = [n for n in model.training_info[0].algorithm.node if n.op_type == "Reshape"]
    assert targets and not any(n.op_type == "Shape" for n in
                               model.training_info[0].algorithm.node), \
        "every batch-dependent Reshape target became a constant"
    for x, y in batches:
        got = run_step(model, {exp.input_names[0]: x, "y": y})
        loss, grads, _ = torch_step(module, x, y, loss_fn, float64=True)
        assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
        errors = gradient_errors(got, grads)
        assert max(errors.values()) <= TOL, (x.shape, errors)

    steps = [batches[0], batches[1], batches[0]]
    theirs = _sgd_reference(module, steps)
    trainer = ngdist.compile(module, torch.from_numpy(batches[0][0][:2]), loss=loss_fn,
                             optimizer=torch.optim.SGD(module.parameters(), lr=LR))
    for x, y in steps:
        trainer.step({exp.input_names[0]: x, "y": y})
    trainer.to_torch()
    for p, value in module.named_parameters():
        assert max_rel_err(value.detach().numpy(), theirs[p]) <= TOL, p


def test_reshape_targets_that_vary_with_the_batch_become_constants():
    """x [batch, 3, 4, length]: x.view(x.size(0), 12, -1) and x.view(3, x.size(0), -1).
    With a static length only the batch axis of each output varies: the first target becomes
    [0, 12, 4] (the input's batch axis copied, so shape inference keeps the symbol ``batch``),
    the second [3, -1, 16] (its input's axis 1 is 3, not the batch). With a symbolic length
    two axes vary and the targets stay computed at run time. Either way the normalized model
    computes numpy's reshapes."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from ngdist.frontends.onnx import normalize_forward

    def model(length):
        i64 = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
        nodes = [helper.make_node("Shape", ["x"], ["s"]),
                 helper.make_node("Gather", ["s", "zero"], ["b"]),
                 helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"]),
                 helper.make_node("Concat", ["b1", "tail"], ["target"], axis=0),
                 helper.make_node("Reshape", ["x", "target"], ["y"], name="view"),
                 helper.make_node("Concat", ["three", "b1", "minus1"], ["target2"], axis=0),
                 helper.make_node("Reshape", ["x", "target2"], ["z"], name="view2")]
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                       ["batch", 3, 4, length])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
             helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
            [i64("zero", 0), i64("axes0", [0]), i64("tail", [12, -1]), i64("three", [3]),
             i64("minus1", [-1])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    def dims(value):
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    for length, folded in ((4, True), ("length", False)):
        norm = normalize_forward(model(length))
        inits = {t.name: numpy_helper.to_array(t) for t in norm.graph.initializer}
        views = {n.name: n for n in norm.graph.node if n.op_type == "Reshape"}
        if folded:
            np.testing.assert_array_equal(inits[views["view"].input[1]], [0, 12, 4])
            np.testing.assert_array_equal(inits[views["view2"].input[1]], [3, -1, 16])
            assert [n.op_type for n in norm.graph.node] == ["Reshape", "Reshape"]
            assert dims(norm.graph.output[0]) == ["batch", 12, 4]
            assert dims(norm.graph.output[1])[0::2] == [3, 16]
        else:
            assert not {v.input[1] for v in views.values()} & set(inits)
        sess = ort.InferenceSession(norm.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.arange(5 * 3 * 4 * (4 if folded else 6), dtype=np.float32).reshape(5, 3, 4, -1)
        y, z = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, x.reshape(5, 12, -1))
        np.testing.assert_array_equal(z, x.reshape(3, 5, -1))


RANKS_SCRIPT = """
import sys
import numpy as np
import ngdist

path, data = sys.argv[1], np.load(sys.argv[2])
trainer = ngdist.compile(path, loss="softmax_cross_entropy", labels="y",
                         optimizer=ngdist.optim.SGD(lr=float(sys.argv[3])), timeout=60)
r, n = trainer.rank, trainer.size
for step in range(int(data["steps"])):
    x, y = data[f"x{step}"], data[f"y{step}"]
    half = len(x) // n
    trainer.step({"x": x[r * half:(r + 1) * half], "y": y[r * half:(r + 1) * half]})
np.savez(f"params{r}.npz", **trainer.parameters())
"""


@pytest.mark.mpi
def test_exported_encoder_with_dynamic_batch_trains_on_two_ranks(ranks, tmp_path):
    """The encoder file on 2 ranks under mpiexec, each rank fed its half of global batches of
    6 and 10 (3 and 5 per rank, one compiled trainer): every rank ends with the parameters of
    torch's SGD on the global batches."""
    torch.manual_seed(0)
    module = Encoder()
    _distinct_parameters(module)
    path = str(tmp_path / "encoder.onnx")
    _export(module, _batch("tokens", 2, 99)[0], path, "torchscript", False)
    names = _file_names(path, module)
    steps = [_batch("tokens", n, seed) for seed, n in enumerate((6, 10, 6))]
    data = {"steps": np.array(len(steps))}
    for i, (x, y) in enumerate(steps):
        data[f"x{i}"], data[f"y{i}"] = x, y
    np.savez(tmp_path / "batches.npz", **data)
    proc = ranks(2, RANKS_SCRIPT, timeout=240,
                 args=[path, str(tmp_path / "batches.npz"), str(LR)])
    assert proc.returncode == 0
    results = [np.load(tmp_path / f"params{r}.npz") for r in range(2)]
    theirs = _sgd_reference(module, steps)
    for mine in results:
        for p, (o, t) in names.items():
            value = np.asarray(mine[o], np.float64)
            assert max_rel_err(value.T if t else value, theirs[p]) <= TOL, p
