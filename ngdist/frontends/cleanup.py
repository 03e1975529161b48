"""Frontend graph cleanups applied to exported models before they become training models.

* ``fold_static_shapes``: exporters compute shapes at run time (Shape -> Gather -> Concat ->
  Reshape) even where only the batch size varies; ONNX shape inference then loses the rank
  of values downstream (torch's ``unflatten`` in multi-head attention is one case), and
  gradient rules need ranks. Every value that depends on shapes only is evaluated in
  onnxruntime for several batch sizes; the ones that do not change become initializers.
  A Reshape whose target varies with the batch gets a constant target with ``0`` or ``-1`` on
  the one axis that varies, so that shape inference sees through ``x.view(batch, ...)``.
  Shapes that depend on data (NonZero's count) are never folded.
* ``squeezing_splits``: torch exports ``unbind`` (``nonzero(as_tuple=True)``) as
  SplitToSequence with a scalar ``split`` of 1 and ``keepdims=0``, meaning 1-D pieces:
  onnxruntime squeezes them, but by the ONNX spec ``keepdims`` is ignored when ``split`` is
  given, so shape inference (and ONNX's reference) keeps the axis, and the passes' shapes,
  planned from inference, disagreed with the run (Longformer's global-attention indices
  broadcast to [n, n, 2]). The ``split`` input is dropped: size-1 pieces with ``keepdims``
  honoured, the same in both.
* ``unbiased_running_var``: PyTorch's BatchNorm updates its running variance with the
  unbiased batch variance, ONNX's BatchNormalization with the biased one.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ngdist.frontends.renames import rename_inputs
from ngdist.frontends.shape_probes import probe_runs
from ngdist.ir.copies import copy_fields, node_subgraphs, outer_reads

logger = logging.getLogger(__name__)

_SHAPE_SOURCES = {"Shape", "Size"}
BATCH_SIZES = (3, 4, 7)  # different parities and residues: a batch-dependent value differs
PROBE_MAX_BYTES = 256 << 20  # probe inputs larger than this (all inputs of one probe) are not made


# ops whose output shapes depend on their inputs' values, not only on their shapes
_DATA_SHAPED_OPS = {"NonZero", "Compress", "Unique", "NonMaxSuppression", "Loop", "Scan", "If",
                    "StringSplit", "RegexFullMatch"}
# inputs (by position) that give another op's output shape
_SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
                 "Slice": (1, 2, 3, 4), "Tile": (1,), "Pad": (1, 3), "Resize": (1, 2, 3),
                 "TopK": (1,), "OneHot": (1,), "Squeeze": (1,), "Unsqueeze": (1,),
                 "Split": (1,), "CenterCropPad": (1,), "Upsample": (1,), "ReduceSum": (1,),
                 "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
                 "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,),
                 "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,)}


def _shape_only_values(model: onnx.ModelProto) -> tuple[list[str], set[str]]:
    """Values computed from shapes and constants only (never from weights or data), in graph
    order; and the values whose shapes depend on data (downstream of NonZero and the like, or
    of a Reshape/Expand/... whose target is computed from data), whose Shape is no such value:
    probing it at a few batch sizes could see the same extent by chance (no token routed to
    one expert in every probe) and fold it."""
    g = model.graph
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
              onnx.TensorProto.BFLOAT16}
    derived = {t.name for t in g.initializer if t.data_type not in floats}
    fixed = {t.name for t in g.initializer}  # what a shape input may be besides derived values
    shaped: set[str] = set()
    order: list[str] = []
    for node in g.node:
        outs = [o for o in node.output if o]
        if node.op_type == "Constant":
            derived.update(outs)
            continue
        shape_inputs = [node.input[k] for k in _SHAPE_INPUTS.get(node.op_type, ())
                        if k < len(node.input) and node.input[k]]
        reads = outer_reads(node)  # an If's branches may read weights it has no input for
        if (node.op_type in _DATA_SHAPED_OPS and not _shape_decided_if(node, derived)) or \
                any(i in shaped for i in reads) or \
                any(i not in derived and i not in fixed for i in shape_inputs):
            shaped.update(outs)
        if node.op_type in _SHAPE_SOURCES:
            if node.input[0] in shaped:
                continue
        elif not (reads and all(i in derived for i in reads)):
            continue
        derived.update(outs)
        order.extend(outs)
    return order, shaped


def _shape_decided_if(node: onnx.NodeProto, derived: set[str]) -> bool:
    """Whether ``node`` is an If whose output shapes follow from shapes alone: its condition
    is computed from shapes and constants, and its branches only take ops whose output shapes
    follow from their inputs' (their shape inputs are the branch's own constants or shape
    values). torch's squeeze of an axis of run-time extent exports so (Squeeze where the
    extent is 1, else Identity); each such If's condition then folds in one probe, not one
    probe per If (a value downstream of an If whose shape is data-dependent is never
    folded)."""
    if node.op_type != "If" or node.input[0] not in derived:
        return False
    for branch in node_subgraphs(node):
        made = {n.output[0] for n in branch.node if n.op_type == "Constant"}
        for inner in branch.node:
            shape_inputs = [inner.input[k] for k in _SHAPE_INPUTS.get(inner.op_type, ())
                            if k < len(inner.input) and inner.input[k]]
            if inner.op_type in _DATA_SHAPED_OPS or \
                    any(i not in made and i not in derived for i in shape_inputs):
                return False
    return True


def fold_static_shapes(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
                       tensors: Mapping[str, onnx.TensorProto] | None = None) -> int:
    """Replaces shape-only values that are equal for every feed by initializers, and gives
    batch-dependent Reshapes a constant target with ``0`` or ``-1`` on the one axis that
    varies.

    ``feeds``: the same inputs at different batch sizes (see ``BATCH_SIZES``). A Reshape
    whose target is computed at run time (``x.view(x.size(0), g, c // g, h, w)`` exports as
    Shape -> Gather -> Concat -> Reshape) is rewritten when its output, at every feed, has the
    same extent on all axes but one: the target becomes those extents with, on the varying
    axis, ``0`` (copy the input's extent) where the input has that same extent on the same
    axis at every feed, else ``-1`` (onnxruntime resolves it from the element count to the
    same value). Shape inference then knows the rank and the static extents downstream, and
    with ``0`` also the input's symbol (``batch``) on that axis, so broadcasting against
    other batch-sized values is resolved statically. Returns the number of values folded
    plus the number of Reshape targets made constant. ``tensors``: the data of the model's
    initializers that hold none (``ngdist.ir.copies``).
    """
    g = model.graph
    candidates, shaped = _shape_only_values(model)
    inits = {t.name for t in g.initializer}
    reshapes = [n for n in g.node if n.op_type == "Reshape" and n.domain in ("", "ai.onnx")
                and len(n.input) > 1 and n.input[1] not in inits and n.input[0] not in shaped
                and n.output[0] not in shaped]
    probes = [(f"{n.output[0]}/ngdist.probe_shape", f"{n.output[0]}/ngdist.probe_in_shape")
              for n in reshapes]
    if (not candidates and not reshapes) or len(feeds) < 2:
        return 0
    probe, weights = _probe_model(model, tensors or {})
    for node, (out_shape, in_shape) in zip(reshapes, probes):
        probe.graph.node.extend([helper.make_node("Shape", [node.output[0]], [out_shape]),
                                 helper.make_node("Shape", [node.input[0]], [in_shape])])
    names = [*candidates, *(name for pair in probes for name in pair)]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    runs = probe_runs(probe, names, feeds, weights)
    if runs is None:
        return 0
    fixed: dict[str, np.ndarray] = {}
    for name in candidates:
        vals = [np.asarray(r[name]) for r in runs]
        if all(v.shape == vals[0].shape and np.array_equal(v, vals[0]) for v in vals[1:]):
            fixed[name] = vals[0]
    targets = 0
    for node, (out_shape, in_shape) in zip(reshapes, probes):
        if node.input[1] in fixed:
            continue
        allowzero = any(a.name == "allowzero" and a.i for a in node.attribute)
        target = _one_free_axis([np.asarray(r[out_shape]) for r in runs],
                                [] if allowzero else [np.asarray(r[in_shape]) for r in runs])
        if target is not None:
            node.input[1] = f"{node.output[0]}/ngdist.target"
            fixed[node.input[1]] = target
            targets += 1
    kept = []
    for node in g.node:
        outs = [o for o in node.output if o]
        if outs and all(o in fixed for o in outs):
            continue
        kept.append(node)
    used = {i for n in kept for i in outer_reads(n)} | {o.name for o in g.output}
    folded = [n for n in fixed if n in used]
    outputs = {o.name for o in g.output}
    # a folded value is an initializer of its own name: the node output it replaces may
    # still be computed in the other export of the module (eval mode), whose graph gets
    # this one's initializers (one name declared twice)
    names = {n: n if n in outputs or n.endswith("/ngdist.target") else f"{n}/ngdist.folded"
             for n in folded}
    g.initializer.extend(numpy_helper.from_array(fixed[n], names[n]) for n in folded)
    for node in kept:
        rename_inputs(node, names)
    del g.node[:]
    g.node.extend(kept)
    remove_dead(g)
    return len(folded)


def constants(g: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The values of ``g`` that are constants: its initializers and its Constant nodes'
    tensors, by name."""
    consts = {t.name: t for t in g.initializer}
    consts.update({n.output[0]: n.attribute[0].t for n in g.node if n.op_type == "Constant"
                   and len(n.attribute) == 1 and n.attribute[0].name == "value"})
    return consts


def squeezing_splits(model: onnx.ModelProto) -> int:
    """Drops the ``split`` input of every SplitToSequence with ``keepdims=0`` whose
    ``split`` is a constant scalar 1 (see the module's docstring); the number rewritten."""
    g = model.graph
    consts = constants(g)
    done = 0
    for node in g.node:
        if node.op_type != "SplitToSequence" or len(node.input) < 2 or \
                node.input[1] not in consts or \
                not any(a.name == "keepdims" and a.i == 0 for a in node.attribute):
            continue
        split = numpy_helper.to_array(consts[node.input[1]])
        if split.ndim == 0 and int(split) == 1:
            del node.input[1:]
            done += 1
    return done


def _probe_model(model: onnx.ModelProto, tensors: Mapping[str, onnx.TensorProto]
                 ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of ``model`` without outputs to probe shapes with, and what it is fed besides
    the data: its float initializers (no shape is computed from them) are inputs, fed as
    arrays read once, not tensors of the copy that is serialised and then read by
    onnxruntime (three copies of the weights otherwise). ``tensors``: the data of initializers
    that hold none in ``model``."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}
    weights = {t.name: t for t in model.graph.initializer if t.data_type in floats}
    probe = copy_fields(model, onnx.ModelProto(), ("graph",))
    copy_fields(model.graph, probe.graph, ("initializer", "output"))
    probe.graph.initializer.extend(tensors.get(t.name, t) for t in model.graph.initializer
                                   if t.name not in weights)
    inputs = {i.name for i in model.graph.input}
    probe.graph.input.extend(helper.make_tensor_value_info(n, t.data_type, list(t.dims))
                             for n, t in weights.items() if n not in inputs)
    return probe, {n: numpy_helper.to_array(tensors.get(n, t)) for n, t in weights.items()}


def _one_free_axis(shapes: list[np.ndarray], inputs: list[np.ndarray]) -> np.ndarray | None:
    """The Reshape target that gives every one of ``shapes`` (the output shapes of one
    Reshape at several batch sizes, ``inputs`` its input shapes, empty when a 0 in the
    target would not copy) when exactly one axis varies and the others are equal and
    non-zero (a 0 would copy an input extent): ``0`` on the varying axis where the input has
    the same extents there, else ``-1``; None otherwise."""
    if len({s.shape for s in shapes}) != 1 or shapes[0].ndim != 1:
        return None
    stacked = np.stack(shapes)
    varying = [a for a in range(stacked.shape[1]) if len(set(stacked[:, a].tolist())) > 1]
    if len(varying) != 1 or not np.all(np.delete(stacked[0], varying) > 0):
        return None
    axis = varying[0]
    copies = bool(inputs) and all(len(i) > axis and i[axis] == s[axis]
                                  for s, i in zip(shapes, inputs))
    target = stacked[0].astype(np.int64)
    target[axis] = 0 if copies else -1
    return target


def probe_feeds(model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """Inputs for ``fold_static_shapes`` from the data inputs' declared types: every
    symbolic or unknown extent takes each of ``BATCH_SIZES`` (a differently rotated sequence
    per dimension name, so up to three named axes never move in lockstep); floats are normal
    noise, other types zeros (valid indices for an embedding). Empty when an input has no
    declared shape, or when one probe's inputs would take more than ``PROBE_MAX_BYTES`` (a
    declared extent far beyond any batch): the graph then stays as it is."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    rng = np.random.default_rng(0)
    symbols: dict[str, int] = {}
    feeds: list[dict[str, np.ndarray]] = [{} for _ in BATCH_SIZES]
    for inp in g.input:
        tt = inp.type.tensor_type
        if inp.name in inits:
            continue
        if not tt.HasField("shape") or not tt.elem_type:
            return []
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        for k, feed in enumerate(feeds):
            dims = []
            for d in tt.shape.dim:
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(d.dim_value)
                    continue
                j = symbols.setdefault(d.dim_param or f"?{inp.name}/{len(dims)}", len(symbols))
                dims.append(BATCH_SIZES[(k + j) % len(BATCH_SIZES)])
            held = sum(v.nbytes for v in feed.values())
            if held + np.prod(dims, dtype=float) * max(dtype.itemsize, 1) > PROBE_MAX_BYTES:
                logger.info("input %r of declared shape %s is too large to probe the graph's "
                            "shapes with; they stay as declared", inp.name, dims)
                return []
            feed[inp.name] = rng.standard_normal(dims).astype(dtype) \
                if np.issubdtype(dtype, np.floating) else np.zeros(dims, dtype)
    return feeds


def remove_dead(g: onnx.GraphProto) -> None:
    """Drops nodes none of whose outputs are used, and unused initializers."""
    while True:
        used = {i for n in g.node for i in outer_reads(n)} | {o.name for o in g.output}
        live = [n for n in g.node if any(o in used for o in n.output if o)]
        if len(live) == len(g.node):
            break
        del g.node[:]
        g.node.extend(live)
    for k in reversed(range(len(g.initializer))):  # (kept ones are not copied again)
        if g.initializer[k].name not in used:
            del g.initializer[k]


def unbiased_running_var(model: onnx.ModelProto) -> int:
    """Makes the running-variance update of training-mode BatchNormalization torch's.

    Works on a training model: for each training-mode BatchNormalization in the algorithm
    whose running variance is bound to the node's own output, the binding moves to
    rv'_onnx + (1 - m) * var_b / (n - 1) (var_b: the biased batch variance, n: elements per
    channel), which is PyTorch's m * rv + (1 - m) * var_b * n / (n - 1). The correction
    reads only the node's input x and its output, never the old running variance: with
    OrtValue feeds, onnxruntime may write the new running variance into the old one's buffer.
    Returns the number of nodes corrected.
    """
    if not model.training_info:
        return 0
    info = model.training_info[0]
    alg = info.algorithm
    binding = {kv.key: kv for kv in info.update_binding}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in
             [*model.graph.value_info, *model.graph.input, *alg.value_info]
             if v.type.tensor_type.HasField("shape")}
    new_nodes: list[onnx.NodeProto] = []
    count = 0
    for node in alg.node:
        new_nodes.append(node)
        training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        if node.op_type != "BatchNormalization" or not training or len(node.output) < 3:
            continue
        x, rv, biased = node.input[0], node.input[4], node.output[2]
        entry = binding.get(rv)
        if not biased or entry is None or entry.value != biased:
            continue
        momentum = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
        p = f"{node.name or biased}/torch_unbiased"
        out = f"{rv}.unbiased"
        new_nodes += _unbiased_nodes(p, x, biased, out, momentum, ranks.get(x))
        entry.value = out
        for o in alg.output:
            if o.name == biased:
                o.name = out
        count += 1
    del alg.node[:]
    alg.node.extend(new_nodes)
    return count


def _unbiased_nodes(p: str, x: str, biased: str, out: str, momentum: float,
                    rank: int | None) -> list[onnx.NodeProto]:
    def const(name: str, value: np.ndarray) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [f"{p}/{name}"], name=f"{p}/{name}",
                                value=numpy_helper.from_array(value))

    def node(op: str, inputs: list[str], name: str, **attrs: object) -> onnx.NodeProto:
        return helper.make_node(op, [i if i in (x, biased) else f"{p}/{i}" for i in inputs],
                                [f"{p}/{name}" if name != "out" else out],
                                name=f"{p}/{name}", **attrs)

    f32 = onnx.TensorProto.FLOAT
    if rank is not None:  # constant axes: shape inference then knows var_b is [C]
        axes = [const("axes", np.array([0, *range(2, rank)], np.int64))]
    else:
        axes = [const("zero_axis", np.array([0], np.int64)), const("two", np.array(2, np.int64)),
                const("step", np.array(1, np.int64)), node("Size", ["shape"], "rank"),
                node("Range", ["two", "rank", "step"], "spatial"),
                node("Concat", ["zero_axis", "spatial"], "axes", axis=0)]
    return [
        const("channel", np.array(1, np.int64)), const("one", np.array(1.0, np.float32)),
        const("one_minus_m", np.array(1.0 - momentum, np.float32)),
        node("Shape", [x], "shape"), *axes,
        node("ReduceMean", [x, "axes"], "mean", keepdims=1),
        node("Sub", [x, "mean"], "centred"), node("Mul", ["centred", "centred"], "squares"),
        node("ReduceMean", ["squares", "axes"], "var_b", keepdims=0),
        node("Size", [x], "size"), node("Gather", ["shape", "channel"], "channels", axis=0),
        node("Cast", ["size"], "size_f", to=f32), node("Cast", ["channels"], "channels_f", to=f32),
        node("Div", ["size_f", "channels_f"], "n"), node("Sub", ["n", "one"], "n_minus_1"),
        node("Div", ["one_minus_m", "n_minus_1"], "coef"),
        node("CastLike", ["coef", "var_b"], "coef_x"),  # the input's float type (float64 too)
        node("Mul", ["coef_x", "var_b"], "extra"), node("Add", [biased, "extra"], "out"),
    ]


def batch_feeds(feeds: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The example inputs cycled along axis 0 to each of ``BATCH_SIZES``."""
    return [{k: np.take(v, np.arange(b) % max(len(v), 1), axis=0) for k, v in feeds.items()}
            for b in BATCH_SIZES]
