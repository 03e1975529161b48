"""Load, save and split training models.

A training model is standard ONNX: ``model.graph`` is the deployable inference graph with the
parameters as initializers, and ``model.training_info[0]`` holds one training step
(``algorithm``) plus ``update_binding``. onnx_ir drops ``training_info``, so this module owns the
conversion between that file format and the *step graph* the passes work on:

* step graph inputs: the data inputs, then every value the step updates or reads as state
  (parameters, buffers such as BatchNorm statistics, optimizer state, hyper-parameters), each
  with its current value as an initializer;
* step graph initializers that are not inputs: constants (frozen weights, shape tensors);
* step graph outputs: the loss, then the new value of every bound name.

The roles of names, the binding and the loss name ride along in ``graph.metadata_props`` so
that every pass sees them.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from ngdist.errors import GraphError, ModelLoadError
from ngdist.ir.atomic import remove_stale_temps_in, write_atomic
from ngdist.ir.copies import (TENSOR_DATA, checker_copy, copy_fields, large, put_tensor_data,
                              outer_reads, without_tensor_data)
from ngdist.ir.domain import DOMAIN, DOMAIN_VERSION
from ngdist.ir.modelfile import (check_nodes, check_tensor_data, check_text, read_model_bytes,
                                 resolve_external_data)
from ngdist.ir.shapes import fill_same_shape_outputs, infer
from ngdist.ir.validate import MODEL_LEVEL, ROLES, check_training_model

__all__ = ["IR_VERSION", "MODEL_LEVEL", "ROLES", "StepMeta", "assemble_training_model",
           "check_proto", "check_training_model", "debias_map", "ensure_opset", "get_meta",
           "load_proto", "remove_stale_temps_in", "save_proto", "set_meta",
           "split_training_model", "uses_domain", "write_atomic"]

logger = logging.getLogger(__name__)

IR_VERSION = 10  # onnxruntime 1.31 reads at most 13; onnx 1.23 would write 14
@dataclass
class StepMeta:
    """What the passes need besides the nodes: roles of names, update binding, loss name."""

    roles: dict[str, str]
    binding: dict[str, str]
    loss: str

    def names(self, role: str) -> list[str]:
        return [n for n, r in self.roles.items() if r == role]


def get_meta(model: ir.Model) -> StepMeta:
    props = model.graph.metadata_props
    try:
        return StepMeta(json.loads(props["ngdist.roles"]), json.loads(props["ngdist.binding"]),
                        props["ngdist.loss"])
    except KeyError as exc:
        raise GraphError(f"step graph lacks ngdist metadata {exc}; build it with "
                         "ngdist.ir.model.split_training_model") from None


def debias_map(step: ir.Model) -> dict[str, str]:
    """parameter -> push-sum weight, read from the ``ngdist.PushSum`` nodes of a step graph.

    A PushSum node's outputs are the mixed parameters then the mixed weight; the names bound to
    them are the parameters and the weight. Empty for graphs without PushSum.
    """
    meta = get_meta(step)
    bound_by_output = {out: name for name, out in meta.binding.items()}
    table: dict[str, str] = {}
    for node in step.graph:
        if node.domain != DOMAIN or node.op_type != "PushSum":
            continue
        names = [bound_by_output.get(o.name) for o in node.outputs]
        if None in names:
            raise GraphError(f"ngdist.PushSum '{node.name}': outputs {[o.name for o in node.outputs]}"
                             " are not all bound to updatable values")
        weight = names[-1]
        table.update({p: weight for p in names[:-1]})
    return table



def set_meta(model: ir.Model, meta: StepMeta) -> None:
    props = model.graph.metadata_props
    props["ngdist.roles"] = json.dumps(meta.roles)
    props["ngdist.binding"] = json.dumps(meta.binding)
    props["ngdist.loss"] = meta.loss


# --------------------------------------------------------------------------- files

def load_proto(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX file, with an error that says what is wrong and what to do.

    Only a regular file within the size limit is read (ir/modelfile.py); external data come
    from files inside the model's folder; a training model's algorithm is validated
    (:func:`check_training_model`)."""
    data = read_model_bytes(path)
    if not data:
        raise ModelLoadError(f"{path}: the file is empty; it is not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError, RecursionError) as exc:
        raise ModelLoadError(
            f"{path}: not a valid ONNX file ({exc}); the file is truncated or not ONNX. "
            "Re-export the model or check the path.") from None
    del data  # (the file's bytes: a whole copy of the model beside it)
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.node:
        raise ModelLoadError(
            f"{path}: parsed, but holds no ONNX graph (ir_version={model.ir_version}, "
            f"{len(model.graph.node)} nodes); the file is truncated or not ONNX")
    check_text(model, str(path))
    check_nodes(model, str(path))
    resolve_external_data(model, Path(os.path.abspath(path)).parent, path)
    check_tensor_data(model, str(path))
    check_proto(model, str(path))
    return model


def check_proto(model: onnx.ModelProto, where: str) -> None:
    """onnx's checker, then :func:`check_training_model`; a ModelLoadError naming ``where``."""
    try:
        onnx.checker.check_model(checker_copy(model))
    except (onnx.checker.ValidationError, ValueError, RuntimeError, RecursionError,
            UnicodeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"{where}: the ONNX model is invalid ({first}); the file may be "
                             "truncated or produced by a broken exporter") from None
    try:
        check_training_model(model)
    except GraphError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


def save_proto(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` atomically (see :func:`write_atomic`)."""
    write_atomic(path, model.SerializeToString())


# --------------------------------------------------------------------------- split / assemble

def _used_names(graph: onnx.GraphProto) -> set[str]:
    return {i for n in graph.node for i in outer_reads(n)} | {o.name for o in graph.output}


def _roles(alg: onnx.GraphProto, main_inits: dict[str, onnx.TensorProto],
           alg_inits: dict[str, onnx.TensorProto], binding: dict[str, str],
           stored: dict[str, str]) -> dict[str, str]:
    """Each step value's role: data (an input of neither graph's initializers), param or a
    stored role (an updated main-graph initializer), state or hyper (the algorithm's)."""
    roles: dict[str, str] = {}
    for inp in alg.input:
        if inp.name not in alg_inits and inp.name not in main_inits:
            roles[inp.name] = "data"
    for name in main_inits:
        if name in binding:
            roles[name] = stored.get(name, "param")
    for name in alg_inits:
        roles[name] = stored.get(name, "state" if name in binding else "hyper")
    missing = [k for k in binding if k not in roles]
    if missing:
        raise GraphError(f"update_binding names {missing}, which are initializers of neither "
                         "the main graph nor the algorithm graph")
    return roles


def _gather_initializers(alg: onnx.GraphProto, info: onnx.TrainingInfoProto,
                         main_inits: dict[str, onnx.TensorProto], binding: dict[str, str]
                         ) -> dict[int, onnx.TensorProto]:
    """Puts the algorithm's initializers and those of the main graph it reads into ``alg``,
    the updated ones also as inputs; the large ones without their data, which the returned
    map (position in ``alg.initializer`` -> tensor) holds for ``put_tensor_data``."""
    used = _used_names(alg)
    sources = [*info.algorithm.initializer]
    existing_inputs = {i.name for i in alg.input}
    # Everything the step reads from the main graph becomes a step input (if updated) or constant.
    for name, tensor in main_inits.items():
        if name not in used and name not in binding:
            continue
        sources.append(tensor)
        if name in binding and name not in existing_inputs:
            alg.input.append(onnx.helper.make_tensor_value_info(
                name, tensor.data_type, list(tensor.dims)))
    for tensor in {t.name: t for t in info.algorithm.initializer}.values():
        if tensor.name not in existing_inputs:
            alg.input.append(onnx.helper.make_tensor_value_info(
                tensor.name, tensor.data_type, list(tensor.dims)))
    dropped = {k: t for k, t in enumerate(sources) if large(t)}
    for k, tensor in enumerate(sources):
        if k in dropped:
            copy_fields(tensor, alg.initializer.add(), TENSOR_DATA)
        else:
            alg.initializer.append(tensor)
    return dropped


def _read_step(step_proto: onnx.ModelProto) -> ir.Model:
    try:
        return ir.from_proto(step_proto)
    except ir.serde.SerdeError as exc:  # what the checks before did not foresee
        cause: BaseException = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise GraphError(f"the training step cannot be read ({type(cause).__name__}: "
                         f"{cause}); the file is damaged or was not written by an ONNX "
                         "exporter") from None


def split_training_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, ir.Model]:
    """ModelProto with training_info -> (inference model, step graph as onnx_ir model)."""
    check_training_model(model)
    if not model.training_info:
        raise GraphError(
            "the model has no training_info: it is a forward-only model. Build a training "
            "model with ngdist.compile(..., loss=..., optimizer=...) or `ngdist rewrite "
            "--loss ... --optimizer ...`")
    info = model.training_info[0]
    # the step graph is built field by field, its large tensors without their data, which
    # each gets once after shape inference: no deep copy, and inference's serialised copies
    # hold no parameters
    alg = copy_fields(info.algorithm, onnx.GraphProto(), ("initializer",))
    binding = {kv.key: kv.value for kv in info.update_binding}
    props = {p.key: p.value for p in model.metadata_props}
    main_inits = {t.name: t for t in model.graph.initializer}
    alg_inits = {t.name: t for t in info.algorithm.initializer}
    roles = _roles(alg, main_inits, alg_inits, binding,
                   json.loads(props.get("ngdist.roles", "{}")))
    dropped = _gather_initializers(alg, info, main_inits, binding)
    # Data inputs first, then updatable values, in a stable order.
    order = {"data": 0, "param": 1, "buffer": 2, "state": 3, "hyper": 4}
    inputs = sorted(alg.input, key=lambda v: order.get(roles.get(v.name, "data"), 0))
    del alg.input[:]
    alg.input.extend(inputs)

    loss = props.get("ngdist.loss") or alg.output[0].name
    opsets = {o.domain: o.version for o in model.opset_import}
    step_proto = onnx.helper.make_model(
        alg, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
        ir_version=IR_VERSION)
    del alg
    try:  # shapes help the autodiff; they are not required
        step_proto = fill_same_shape_outputs(infer(step_proto))
    except Exception as exc:
        logger.debug("shape inference of the step graph failed: %s", exc)
    put_tensor_data(step_proto.graph, dropped)
    step = _read_step(step_proto)
    set_meta(step, StepMeta(roles, binding, loss))
    inference = copy_fields(model, onnx.ModelProto(), ("training_info",))
    return inference, step


def assemble_training_model(inference: onnx.ModelProto, step: ir.Model,
                            values: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Inverse of split_training_model. ``values`` overrides initial values (trained weights)."""
    meta = get_meta(step)
    values = values or {}
    model = copy.deepcopy(inference)
    main_names = {t.name for t in model.graph.initializer}
    for t in model.graph.initializer:
        if t.name in values:
            t.CopyFrom(numpy_helper.from_array(np.asarray(values[t.name]), t.name))
    step_proto = ir.to_proto(step)
    alg = step_proto.graph
    for p in list(alg.metadata_props):
        if p.key.startswith("ngdist."):
            alg.metadata_props.remove(p)
    keep_inputs = [i for i in alg.input if meta.roles.get(i.name, "data") == "data"]
    del alg.input[:]
    alg.input.extend(keep_inputs)
    kept = []
    for t in alg.initializer:
        role = meta.roles.get(t.name)
        if t.name in main_names:
            if role in MODEL_LEVEL and t.name not in values:
                # keep the main graph in step with the step graph's current value
                for mt in model.graph.initializer:
                    if mt.name == t.name:
                        mt.CopyFrom(t)
            continue
        if role in MODEL_LEVEL:  # a parameter that the inference graph does not hold
            model.graph.initializer.append(
                numpy_helper.from_array(np.asarray(values[t.name]), t.name)
                if t.name in values else t)
            continue
        kept.append(numpy_helper.from_array(np.asarray(values[t.name]), t.name)
                    if t.name in values else t)
    del alg.initializer[:]
    alg.initializer.extend(kept)
    info = model.training_info.add()
    info.algorithm.CopyFrom(alg)
    for k, v in meta.binding.items():
        entry = info.update_binding.add()
        entry.key, entry.value = k, v
    opsets = {o.domain: o.version for o in model.opset_import}
    for o in step_proto.opset_import:
        opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
    del model.opset_import[:]
    model.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in opsets.items())
    model.ir_version = IR_VERSION
    for key, value in (("ngdist.roles", json.dumps(meta.roles)), ("ngdist.loss", meta.loss)):
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                            key: value})
    return model


def uses_domain(step: ir.Model, domain: str = DOMAIN) -> bool:
    return any(n.domain == domain for n in step.graph)


def ensure_opset(step: ir.Model, domain: str, version: int = DOMAIN_VERSION) -> None:
    step.opset_imports.setdefault(domain, version)
    step.graph.opset_imports.setdefault(domain, version)
