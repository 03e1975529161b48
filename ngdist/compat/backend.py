"""ngdist as an ONNX backend (``onnx.backend.base.Backend``).

Tools that drive ONNX backends (ONNX's own ``onnx.backend.test.BackendTest`` among them) can
run ngdist through this module: ``prepare``, ``run_model``, ``run_node`` and
``supports_device`` exist both as module functions and on :class:`NgdistBackend`.

What ``prepare(model)`` returns depends on the model:

* **Inference model** (no ``ai.onnx.preview.training`` node, no ``training_info``): an
  :class:`InferenceRep` running the graph on onnxruntime (CPU provider). Models stamped with an
  opset newer than onnxruntime implements are re-stamped to the newest one it does when every op
  of the graph has the same definition in both (a no-op for the semantics).
* **Plain graph with preview training ops** (``Gradient``, ``Momentum``, ``Adagrad``,
  ``Adam`` used as ordinary nodes, as in ONNX's node tests and ``test_gradient_of_*``): the graph
  is brought to opset >= 18 and lowered with ngdist's own passes (``AutodiffPass`` turns each
  ``Gradient`` into ordinary backward ops, ``OptimizerLoweringPass`` rewrites the optimizer ops),
  then run like an inference model; ``run`` is stateless, as the ONNX spec defines these ops.
* **Training model** (``training_info`` present, e.g. from ``Trainer.save`` or ``ngdist
  rewrite``): a :class:`TrainingRep` wrapping ``ngdist.compile(model, **kwargs)``.
  Convention: ``rep.run(inputs)`` performs **one training step** on the batch (``inputs`` in
  the order of the algorithm's data inputs, or a dict by name) and returns ``(loss,)``; the
  parameters and optimizer state are updated in place (``rep.parameters()``,
  ``rep.state_dict()``, ``rep.to_onnx()``), and ``rep.infer(inputs)`` runs the inference graph
  with the current parameters. Launched under mpiexec, every rank calls ``run`` with its own
  shard and the step is data-parallel (the strategy is ``ngdist.compile``'s, default
  ``allreduce``). ``prepare(model, mode="inference")`` runs the inference graph instead.

Only the CPU device is supported (``supports_device("CUDA")`` is False).
"""
from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import defs, helper, version_converter
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from ngdist.errors import ArgumentError, ArgumentTypeError, GraphError, InputError
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.model import IR_VERSION, StepMeta, load_proto, set_meta
from ngdist.runtime.sessions import make_session

logger = logging.getLogger(__name__)

TRAINING_OPS = ("Gradient", "Momentum", "Adagrad", "Adam")
LOWERING_OPSET = 18  # the opset ngdist's gradient rules and optimizer lowering emit
ORT_MAX_IR_VERSION = 13
ORT_MIN_OPSET = 7  # onnxruntime lacks kernels for some older definitions (BatchNormalization-6)
_IGNORED_KWARGS = {"rtol", "atol"}  # passed to prepare() by onnx's test runner
_SESSION_KWARGS = {"providers", "intra_op_threads"}


# ----------------------------------------------------------------------------- helpers

@functools.lru_cache(maxsize=1)
def ort_max_opset() -> int:
    """The newest default-domain opset this onnxruntime accepts (probed once)."""
    for version in range(defs.onnx_opset_version(), 6, -1):
        model = helper.make_model(
            helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]),
            opset_imports=[helper.make_opsetid("", version)], ir_version=IR_VERSION)
        try:
            make_session(model)
        except Exception:  # noqa: BLE001 - any refusal means "too new"
            continue
        return version
    return LOWERING_OPSET


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _set_default_opset(model: onnx.ModelProto, version: int) -> None:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = version


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_nodes(g)


def uses_training_ops(model: onnx.ModelProto) -> bool:
    return any(n.domain == PREVIEW_TRAINING for n in _all_nodes(model.graph))


def restamp_opset(model: onnx.ModelProto, target: int) -> bool:
    """Lower the default-domain opset stamp to ``target`` in place when every op used has the
    same definition at both versions (so the meaning is unchanged). Returns whether it did."""
    current = _default_opset(model)
    if current <= target:
        return False
    local = {f.name for f in model.functions}
    for node in _all_nodes(model.graph):
        if node.domain not in ("", "ai.onnx") or node.op_type in local:
            continue
        try:
            new = defs.get_schema(node.op_type, current, "").since_version
            old = defs.get_schema(node.op_type, target, "").since_version
        except defs.SchemaError:
            return False
        if new != old:
            return False
    _set_default_opset(model, target)
    return True


def fit_to_onnxruntime(model: onnx.ModelProto) -> onnx.ModelProto:
    """A model stamped newer than onnxruntime reads, brought down without changing its meaning:
    re-stamped when no op's definition differs, else through onnx's version converter (whose
    adapters refuse conversions that would change it). Unchanged when neither works."""
    model = copy.deepcopy(model)
    model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
    target = ort_max_opset()
    if _default_opset(model) <= target or restamp_opset(model, target):
        return model
    try:
        converted = version_converter.convert_version(model, target)
    except Exception as exc:  # noqa: BLE001 - the converter refuses: onnxruntime will say why
        logger.info("opset %d -> %d conversion refused: %s", _default_opset(model), target,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return model
    converted.ir_version = min(converted.ir_version, ORT_MAX_IR_VERSION)
    return converted


def _upgrade_opset(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    try:
        return version_converter.convert_version(model, target)
    except Exception as exc:
        raise GraphError(f"cannot convert the model from opset {_default_opset(model)} to "
                         f"{target}: {exc}") from None


def lower_training_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """A plain graph using ``ai.onnx.preview.training`` ops -> the same graph in ordinary ops."""
    from ngdist.passes.pipeline import run_passes

    unknown = sorted({n.op_type for n in _all_nodes(model.graph)
                      if n.domain == PREVIEW_TRAINING and n.op_type not in TRAINING_OPS})
    if unknown:
        raise GraphError(f"ai.onnx.preview.training ops {unknown} are not supported; ngdist "
                         f"lowers {list(TRAINING_OPS)}")
    if any(n.domain == PREVIEW_TRAINING for g in _subgraphs(model.graph) for n in g.node):
        raise GraphError("ai.onnx.preview.training ops inside control-flow subgraphs are not "
                         "supported; use them in the main graph")
    model = copy.deepcopy(model)
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", LOWERING_OPSET))
    elif _default_opset(model) < LOWERING_OPSET:
        model = _upgrade_opset(model, LOWERING_OPSET)
    model.ir_version = IR_VERSION
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # shapes help the gradient rules; not required
        logger.debug("shape inference before lowering failed: %s", exc)
    step = ir.from_proto(model)
    gradients = [n for n in step.graph if n.domain == PREVIEW_TRAINING and n.op_type == "Gradient"]
    loss = gradients[0].attributes["y"].value if gradients else step.graph.outputs[0].name
    set_meta(step, StepMeta({v.name: "data" for v in step.graph.inputs}, {}, str(loss)))
    step = run_passes(step, "local")
    out = ir.to_proto(step)
    for p in list(out.graph.metadata_props):
        if p.key.startswith("ngdist."):
            out.graph.metadata_props.remove(p)
    out.ir_version = IR_VERSION
    return out


def _subgraphs(graph: onnx.GraphProto):
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield a.g
                yield from _subgraphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield g
                    yield from _subgraphs(g)


def _feeds(names: Sequence[str], inputs: Any) -> dict[str, Any]:
    if isinstance(inputs, Mapping):
        unknown = [k for k in inputs if k not in names]
        missing = [n for n in names if n not in inputs]
        if unknown or missing:
            raise InputError(f"inputs {sorted(inputs)} do not match the model's inputs "
                             f"{list(names)} (missing {missing}, unknown {unknown})")
        return {k: _array(v) for k, v in inputs.items()}
    if isinstance(inputs, (np.ndarray, np.generic)):
        inputs = [inputs]
    inputs = [_array(v) for v in inputs]
    if len(inputs) != len(names):
        raise InputError(f"got {len(inputs)} input(s); the model takes {len(names)}: "
                         f"{list(names)}")
    return dict(zip(names, inputs))


def _array(value: Any) -> Any:
    """numpy scalars become 0-d arrays (onnxruntime takes arrays, lists for sequences)."""
    return np.asarray(value) if isinstance(value, np.generic) else value


def _check_device(device: str) -> None:
    if not supports_device(device):
        raise GraphError(f"device {device!r} is not supported by ngdist.backend; use 'CPU'")


# ----------------------------------------------------------------------------- reps

class InferenceRep(BackendRep):
    """Runs an inference graph (or a lowered graph of training ops) on onnxruntime."""

    def __init__(self, model: onnx.ModelProto, providers: list[str] | None = None,
                 intra_op_threads: int | None = None) -> None:
        self.model = model
        if providers not in (None, ["CPUExecutionProvider"]):
            raise GraphError(f"ngdist.backend runs on the CPU; providers={providers} is not "
                             "supported")
        self.session = make_session(model, intra_op_threads=intra_op_threads)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        outputs = self.session.run(None, _feeds(self.input_names, inputs))
        return namedtupledict("Outputs", self.output_names)(*outputs)


class TrainingRep(BackendRep):
    """A training model: ``run(inputs)`` performs one training step and returns ``(loss,)``."""

    def __init__(self, model: onnx.ModelProto, **compile_options: Any) -> None:
        import ngdist

        self.trainer = ngdist.compile(model, **compile_options)
        self.input_names = list(self.trainer.data_inputs)
        self.loss_name = self.trainer.meta.loss

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        stats = self.trainer.step(_feeds(self.input_names, inputs))
        return namedtupledict("Outputs", [self.loss_name])(np.array(stats.loss, np.float32))

    def infer(self, inputs: Any) -> list[np.ndarray]:
        names = [i.name for i in self.trainer.inference.graph.input
                 if i.name not in {t.name for t in self.trainer.inference.graph.initializer}]
        return self.trainer.predict(_feeds(names, inputs))

    def parameters(self) -> dict[str, np.ndarray]:
        return self.trainer.parameters()

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.trainer.state_dict()

    def to_onnx(self) -> onnx.ModelProto:
        return self.trainer.to_onnx()


# ----------------------------------------------------------------------------- backend

class NgdistBackend(Backend):
    """``onnx.backend.base.Backend`` implemented by ngdist (see the module docstring)."""

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return Device(device).type == DeviceType.CPU
        except (AttributeError, ValueError):
            return False

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        if not cls.supports_device(device):
            return False
        return all(n.op_type in TRAINING_OPS for n in _all_nodes(model.graph)
                   if n.domain == PREVIEW_TRAINING)

    @classmethod
    def prepare(cls, model: onnx.ModelProto | str | bytes, device: str = "CPU",
                **kwargs: Any) -> BackendRep:
        _check_device(device)
        if isinstance(model, (str, bytes)) and not isinstance(model, onnx.ModelProto):
            # a path is read as ngdist reads every model file (ir/modelfile.py)
            model = onnx.load_model_from_string(model) if isinstance(model, bytes) \
                else load_proto(model)
        mode = kwargs.pop("mode", "train")
        if model.training_info and mode == "train":
            return TrainingRep(model, **{k: v for k, v in kwargs.items()
                                         if k not in _IGNORED_KWARGS})
        if mode not in ("train", "inference"):
            raise ArgumentError(f"mode must be 'train' or 'inference', not {mode!r}")
        unknown = set(kwargs) - _IGNORED_KWARGS - _SESSION_KWARGS
        if unknown:
            raise ArgumentTypeError(f"prepare() got unexpected options {sorted(unknown)} for an "
                            f"inference model; it takes {sorted(_SESSION_KWARGS)}")
        session = {k: v for k, v in kwargs.items() if k in _SESSION_KWARGS}
        if model.training_info:
            model = copy.deepcopy(model)
            del model.training_info[:]
        if uses_training_ops(model):
            return InferenceRep(lower_training_ops(model), **session)
        if 0 < _default_opset(model) < ORT_MIN_OPSET:
            model = _upgrade_opset(model, ORT_MIN_OPSET)
        if model.ir_version > ORT_MAX_IR_VERSION or _default_opset(model) > ort_max_opset():
            model = fit_to_onnxruntime(model)
        return InferenceRep(model, **session)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        """Run one node on ``inputs`` (arrays in the order of ``node.input``)."""
        arrays = [np.asarray(a) for a in (inputs.values() if isinstance(inputs, Mapping)
                                          else inputs)]
        names = [n for n in node.input if n]
        if len(arrays) != len(names):
            raise InputError(f"node {node.op_type} has {len(names)} non-empty input(s) "
                             f"{names}; got {len(arrays)} array(s)")
        graph_inputs = [helper.make_tensor_value_info(
            n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, arrays)]
        outs = [n for n in node.output if n]
        if outputs_info is not None:
            graph_outputs = [helper.make_tensor_value_info(
                n, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)
                for n, (dt, shape) in zip(outs, outputs_info)]
        else:
            graph_outputs = [helper.make_empty_tensor_value_info(n) for n in outs]
        opset = kwargs.pop("opset_version", None)
        if node.domain == PREVIEW_TRAINING:
            opsets = [helper.make_opsetid("", opset or LOWERING_OPSET),
                      helper.make_opsetid(PREVIEW_TRAINING, 1)]
        else:
            opsets = [helper.make_opsetid(node.domain, opset or ort_max_opset())]
        model = helper.make_model(
            helper.make_graph([node], f"run_node_{node.op_type}", graph_inputs, graph_outputs),
            opset_imports=opsets, ir_version=IR_VERSION)
        return cls.prepare(model, device, **kwargs).run(arrays)


prepare = NgdistBackend.prepare
run_model = NgdistBackend.run_model
run_node = NgdistBackend.run_node
supports_device = NgdistBackend.supports_device
is_compatible = NgdistBackend.is_compatible
