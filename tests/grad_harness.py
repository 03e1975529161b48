"""The finite-difference harness of the gradient-rule tests.

Each case is a tiny model: the op (or a few ops) -> a scalar loss sum_i ReduceSum(y_i * w_i)
with fixed random weights w_i. ``ngdist.passes.autodiff.AutodiffPass`` lowers a
``Gradient`` node of that model; the gradients it emits are compared, in float64, with central
differences of the untouched forward model. Both models run on onnxruntime; where onnxruntime
has no float64 kernel (Conv, ConvTranspose, AveragePool, Erf, OneHot...) they run on ONNX's
reference evaluator instead. The same gradient graph is then run in float32 on onnxruntime,
the runtime training uses, and must agree with the float64 result; ``onnx.checker`` must
accept the gradient graph.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops._op import OpRunUnaryNum
from onnx.reference.ops.op_conv_transpose import ConvTranspose as _RefConvTranspose

from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.model import IR_VERSION
from ngdist.passes.autodiff import AutodiffPass

H = 1e-6  # central-difference step (float64)


class ConvTranspose(_RefConvTranspose):
    """onnx 1.23's reference ConvTranspose mixes up channels when group > 1: run each group
    through its (correct) group == 1 path and concatenate the results."""

    def _run(self, X, W, B=None, group=None, **kw):  # type: ignore[override]
        if not group or group == 1:
            return super()._run(X, W, B, group=1, **kw)
        cin, cout = X.shape[1] // group, W.shape[1]
        parts = [super(ConvTranspose, self)._run(
            X[:, i * cin:(i + 1) * cin], W[i * cin:(i + 1) * cin],
            None if B is None else B[i * cout:(i + 1) * cout], group=1, **kw)[0]
            for i in range(group)]
        return (np.concatenate(parts, axis=1),)


class Erf(OpRunUnaryNum):
    """onnx 1.23's reference Erf rounds through float32; keep float64 precision."""

    def _run(self, x):  # type: ignore[override]
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


class Gelu(OpRun):
    """onnx 1.23 evaluates Gelu through its function body with the float32 Erf above."""

    op_domain = ""

    def _run(self, x, approximate="none"):  # type: ignore[override]
        if approximate == "tanh":
            inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
            return ((0.5 * x * (1 + np.tanh(inner))).astype(x.dtype),)
        cdf = 0.5 * (1 + np.vectorize(math.erf, otypes=[x.dtype])(x / math.sqrt(2)))
        return ((x * cdf).astype(x.dtype),)


class LRN(OpRun):
    """onnx 1.23's reference LRN does not sum the squares over ONNX's channel window (0.1 off
    onnxruntime on random data); this one follows the operator's definition."""

    op_domain = ""

    def _run(self, x, alpha=1e-4, beta=0.75, bias=1.0, size=None):  # type: ignore[override]
        lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
        square = np.zeros_like(x)
        for c in range(x.shape[1]):
            square[:, c] = (x[:, max(0, c - lo):c + hi + 1] ** 2).sum(axis=1)
        return ((x / (bias + alpha / size * square) ** beta).astype(x.dtype),)


class MeanVarianceNormalization(OpRun):
    """onnx 1.23's function body adds a float32 epsilon to float64 values and fails (so does
    onnxruntime's float64 kernel); this one keeps the input's type."""

    op_domain = ""

    def _run(self, x, axes=None):  # type: ignore[override]
        axes = tuple(axes) if axes is not None else (0, 2, 3)
        centered = x - x.mean(axis=axes, keepdims=True)
        sigma = np.sqrt((centered ** 2).mean(axis=axes, keepdims=True))
        return ((centered / (sigma + 1e-9)).astype(x.dtype),)


# ----------------------------------------------------------------------------- the table

@dataclass
class Const:
    """A float input that is a constant of the model, not differentiated."""

    value: np.ndarray


@dataclass
class Case:
    id: str
    nodes: list[onnx.NodeProto]
    inputs: dict[str, np.ndarray]  # differentiated graph inputs (float64)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)  # weighted into the loss
    opset: int = 18
    # True: every input dim symbolic; "batch": only dim 0; "spatial": dims 2: of the first input
    symbolic: bool | str = False
    fresh: bool = False  # a new session per evaluation (random ops with a fixed seed)
    reference: bool = False  # float64 on ONNX's reference evaluator even if onnxruntime can

    def __repr__(self) -> str:
        return self.id


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(key.encode()))


class Gen:
    """Random inputs of one case, reproducible from the case id."""

    def __init__(self, key: str) -> None:
        self.rng = _rng(key)

    def n(self, *shape: int) -> np.ndarray:
        return self.rng.standard_normal(shape)

    def away(self, *shape: int, gap: float = 0.1) -> np.ndarray:
        """Away from zero (kinks of Relu, Abs...)."""
        return self.rng.choice([-1.0, 1.0], shape) * self.rng.uniform(gap, 1.5, shape)

    def pos(self, *shape: int) -> np.ndarray:
        return self.rng.uniform(0.5, 2.0, shape)

    def distinct(self, *shape: int) -> np.ndarray:
        """All values distinct, at least 0.01 apart (max/min keep their argument under +-H)."""
        size = int(np.prod(shape))
        return self.rng.permutation(np.linspace(-2.0, 2.0, size)).reshape(shape)


def op_case(cid: str, op: str, inputs: list, n_out: int = 1, used: list[int] | None = None,
            opset: int = 18, symbolic: bool | str = False, fresh: bool = False, domain: str = "",
            reference: bool = False, **attrs) -> Case:
    """One node. inputs: float arrays are differentiated, Const/int/bool arrays are constants,
    None is an absent optional input."""
    names, diff, consts = [], {}, {}
    for i, v in enumerate(inputs):
        if v is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if isinstance(v, Const):
            consts[name] = np.asarray(v.value)
        elif np.asarray(v).dtype.kind == "f":
            diff[name] = np.asarray(v, np.float64)
        else:
            consts[name] = np.asarray(v)
    outs = [f"out{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, name="node0", domain=domain, **attrs)
    return Case(cid, [node], diff, consts, [outs[i] for i in (used or [0])], opset, symbolic,
                fresh, reference)


def case(cid: str, op: str, make, **kw) -> Case:
    """``op_case`` with the inputs ``make(Gen(cid))`` (reproducible from the id)."""
    return op_case(cid, op, make(Gen(cid)), **kw)


def graph_case(cid: str, nodes: list[onnx.NodeProto], inputs: dict, consts: dict | None = None,
               outputs: list[str] | None = None, opset: int = 18) -> Case:
    return Case(cid, nodes, {k: np.asarray(v, np.float64) for k, v in inputs.items()},
                dict(consts or {}), outputs or [nodes[-1].output[0]], opset)


def mk(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, name=f"{op.lower()}_{outs[0]}", **attrs)



# ----------------------------------------------------------------------------- the harness

def _elem(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _symbolic(mode: bool | str, name: str, axis: int) -> bool:
    if mode == "spatial":
        return name == "in0" and axis >= 2
    return mode is True or axis == 0


def _cast(arr: np.ndarray, dtype) -> np.ndarray:
    return arr.astype(dtype) if arr.dtype.kind == "f" else arr


def _model(case: Case, dtype, outputs: list[str], extra_nodes=(), weights=None,
           extra_outputs=()) -> onnx.ModelProto:
    inputs = []
    for name, arr in case.inputs.items():
        dims: list = list(arr.shape)
        if case.symbolic:
            dims = [f"{name}_d{i}" if _symbolic(case.symbolic, name, i) else d
                    for i, d in enumerate(dims)]
        inputs.append(helper.make_tensor_value_info(name, _elem(dtype), dims))
    inits = [numpy_helper.from_array(_cast(v, dtype), k) for k, v in case.consts.items()]
    inits += [numpy_helper.from_array(_cast(v, dtype), k) for k, v in (weights or {}).items()]
    outs = [onnx.ValueInfoProto(name=o) for o in [*outputs, *extra_outputs]]
    graph = helper.make_graph([*case.nodes, *extra_nodes], case.id, inputs, outs, inits)
    opsets = [helper.make_opsetid("", case.opset), helper.make_opsetid(PREVIEW_TRAINING, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def _loss_nodes(case: Case) -> tuple[list[onnx.NodeProto], list[str]]:
    nodes, parts = [], []
    for i, out in enumerate(case.outputs):
        nodes += [mk("CastLike", [f"w{i}", out], [f"wc{i}"]),
                  mk("Mul", [out, f"wc{i}"], [f"wy{i}"]),
                  mk("ReduceSum", [f"wy{i}"], [f"part{i}"], keepdims=0)]
        parts.append(f"part{i}")
    nodes.append(mk("Sum", parts, ["loss"]))
    return nodes, parts


class Runner:
    """onnxruntime when it can run the model, else ONNX's reference evaluator."""

    def __init__(self, model: onnx.ModelProto, fresh: bool = False, ort_only: bool = False,
                 reference: bool = False):
        self.model, self.fresh = model, fresh
        self.bytes = model.SerializeToString()
        try:
            if reference:
                raise NotImplementedError("NOT_IMPLEMENTED: reference evaluator asked for")
            self.sess = self._ort()
        except Exception as exc:  # onnxruntime lacks a kernel (float64 Conv, Erf, ...)
            if ort_only or "NOT_IMPLEMENTED" not in str(exc):
                raise
            self.sess = None
            self.ref = ReferenceEvaluator(model, new_ops=[ConvTranspose, Erf, Gelu, LRN,
                                                            MeanVarianceNormalization])

    def _ort(self) -> ort.InferenceSession:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        return ort.InferenceSession(self.bytes, opts, providers=["CPUExecutionProvider"])

    @property
    def backend(self) -> str:
        return "onnxruntime" if self.sess is not None else "reference"

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.sess is None:
            return [np.asarray(v) for v in self.ref.run(None, feeds)]
        sess = self._ort() if self.fresh else self.sess
        return sess.run(None, feeds)


def weights_for(case: Case) -> dict[str, np.ndarray]:
    probe = Runner(_model(case, np.float64, case.outputs), case.fresh, reference=case.reference)
    outs = probe(dict(case.inputs))
    rng = _rng("weights/" + case.id)
    return {f"w{i}": rng.standard_normal(np.shape(o)) for i, o in enumerate(outs)}


def grad_model(case: Case, dtype, weights) -> onnx.ModelProto:
    """The forward model + loss + a Gradient node, lowered by AutodiffPass."""
    loss_nodes, _ = _loss_nodes(case)
    xs = list(case.inputs)
    grad = helper.make_node("Gradient", xs, [f"{x}.grad" for x in xs], name="gradient",
                            domain=PREVIEW_TRAINING, xs=xs, y="loss")
    proto = _model(case, dtype, ["loss", *[f"{x}.grad" for x in xs]],
                   [*loss_nodes, grad], weights)
    proto = onnx.shape_inference.infer_shapes(proto)
    model = ir.from_proto(proto)
    AutodiffPass()(model)
    assert not [n for n in model.graph if n.domain == PREVIEW_TRAINING]
    lowered = ir.to_proto(model)
    onnx.checker.check_model(lowered)
    try:  # strict type and shape inference over every node the rules emitted
        onnx.checker.check_model(lowered, full_check=True)
    except onnx.shape_inference.InferenceError as exc:
        # a case whose forward model is outside the schema (Celu in float64) or whose loss
        # adds a float32 statistic to float64 values fails in its own nodes; the backward
        # nodes' names hold "/grad/"
        if "/grad/" in str(exc) or _strictly_typed(forward_model(case, weights)):
            raise
    return lowered


def _strictly_typed(model: onnx.ModelProto) -> bool:
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError:
        return False
    return True


def forward_model(case: Case, weights) -> onnx.ModelProto:
    loss_nodes, _ = _loss_nodes(case)
    return _model(case, np.float64, ["loss"], loss_nodes, weights)


def central_differences(run: Runner, feeds: dict[str, np.ndarray], name: str) -> np.ndarray:
    x = feeds[name]
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        vals = []
        for sign in (1.0, -1.0):
            moved = x.copy()
            moved[idx] += sign * H
            vals.append(float(run({**feeds, name: moved})[0]))
        out[idx] = (vals[0] - vals[1]) / (2 * H)
    return out


def check_case(case: Case) -> dict[str, np.ndarray]:
    weights = weights_for(case)
    feeds = dict(case.inputs)
    run64 = Runner(grad_model(case, np.float64, weights), case.fresh, reference=case.reference)
    got = run64(feeds)
    fwd = Runner(forward_model(case, weights), case.fresh, reference=case.reference)
    np.testing.assert_allclose(got[0], fwd(feeds)[0], rtol=1e-7, atol=1e-9,
                               err_msg="the gradient model changed the loss")
    grads = dict(zip(case.inputs, got[1:]))
    for name in case.inputs:
        expected = central_differences(fwd, feeds, name)
        scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
        np.testing.assert_allclose(
            grads[name], expected, rtol=1e-5, atol=1e-6 * scale,
            err_msg=f"{case.id}: d loss / d {name} vs central differences ({fwd.backend})")
    # the same gradient graph in float32 on onnxruntime, the runtime that trains
    run32 = Runner(grad_model(case, np.float32, weights), case.fresh, ort_only=True)
    got32 = run32({k: v.astype(np.float32) for k, v in feeds.items()})
    for name, g32 in zip(case.inputs, got32[1:]):
        scale = max(1.0, float(np.abs(grads[name]).max(initial=0.0)))
        np.testing.assert_allclose(g32, grads[name], rtol=2e-4, atol=2e-4 * scale,
                                   err_msg=f"{case.id}: float32 gradient of {name}")
    return grads



def loss_model(nodes: list[onnx.NodeProto], x_dims: list | None, *, opset: int = 18,
               initializers=()) -> ir.Model:
    """x (float32, shape ``x_dims``) -> ``nodes`` -> y -> loss sum(y), with a Gradient node of
    the loss for x; shapes inferred."""
    nodes = [*nodes, helper.make_node("ReduceSum", ["y"], ["loss"], name="sum0", keepdims=0),
             helper.make_node("Gradient", ["x"], ["x.grad"], name="gradient",
                              domain=PREVIEW_TRAINING, xs=["x"], y="loss")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
        [helper.make_tensor_value_info("x.grad", TensorProto.FLOAT, x_dims)],
        list(initializers))
    proto = helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(PREVIEW_TRAINING, 1)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def lowering_error(nodes: list[onnx.NodeProto], x_dims: list | None, *, opset: int = 18,
                   initializers=()) -> str:
    """The GradientError message of lowering ``loss_model``; fails if the lowering
    succeeds."""
    import pytest

    from ngdist.errors import GradientError

    model = loss_model(nodes, x_dims, opset=opset, initializers=initializers)
    with pytest.raises(GradientError) as info:
        AutodiffPass()(model)
    return str(info.value)


def grads_of(case: Case) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(float64 gradients of the case's inputs, the loss weights)."""
    weights = weights_for(case)
    run = Runner(grad_model(case, np.float64, weights))
    return dict(zip(case.inputs, run(dict(case.inputs))[1:])), weights


def check_reuse(case: Case) -> None:
    """The backward pass reads the forward node's outputs (adding outputs such as MaxPool's
    Indices or Dropout's mask to it) and never runs the forward op a second time."""
    op = case.nodes[0].op_type
    lowered = grad_model(case, np.float32, weights_for(case))
    # BatchNormalization's backward uses inference-mode BatchNormalization with epsilon 0 as
    # a per-channel affine map; that is not the forward op run again
    affine = [n for n in lowered.graph.node if n.op_type == "BatchNormalization"
              and "/grad/" in n.name and any(a.name == "epsilon" and a.f == 0.0
                                             for a in n.attribute)]
    assert len(affine) == (2 if op == "BatchNormalization" else 0)
    assert sum(n.op_type == op for n in lowered.graph.node) == 1 + len(affine)
    forward = next(n for n in lowered.graph.node if n.name == "node0")
    if op in ("MaxPool", "Dropout"):
        extra = forward.output[1]
        assert extra and any(extra in n.input for n in lowered.graph.node if n is not forward)
    if op == "Dropout":
        assert not [n for n in lowered.graph.node if "Random" in n.op_type]
    if op == "LayerNormalization":  # float32 statistics of float32 data are reused
        assert len(forward.output) == 3 and all(forward.output)
