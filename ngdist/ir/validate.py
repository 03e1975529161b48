"""Validation of training models: what ngdist refuses before it builds anything.

The roles of a step's values, the element types it can hold, and :func:`check_training_model`,
which names what is wrong with a training model ngdist could not run.
"""
from __future__ import annotations

import json
from collections import Counter

import onnx
from onnx import TensorProto

from ngdist.errors import GraphError
from ngdist.ir.domain import PREVIEW_TRAINING

ROLES = ("data", "param", "buffer", "state", "hyper")
MODEL_LEVEL = ("param", "buffer")  # roles whose values live in model.graph.initializer
# training ops whose inputs are all required (an empty name is no value)
_ALL_INPUTS_REQUIRED = ("Momentum", "Adagrad", "Adam")
# element types of the values a step is fed or updates (held as numpy arrays and OrtValues)
NUMPY_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                         TensorProto.BFLOAT16, TensorProto.INT64, TensorProto.INT32,
                         TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16,
                         TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
                         TensorProto.BOOL})
_TYPE_NAMES = frozenset(TensorProto.DataType.values())


def _numpy_type_names() -> str:
    return ", ".join(sorted(TensorProto.DataType.Name(t) for t in NUMPY_TYPES))


def _type_name(elem: int) -> str | int:
    """An element type by its ONNX name, or the number itself when ONNX defines none."""
    return TensorProto.DataType.Name(elem) if elem in _TYPE_NAMES else elem


def check_training_model(model: onnx.ModelProto) -> None:
    """Refuses (GraphError naming what is wrong) a training model that ngdist could not run:
    an algorithm that reads values nothing defines, an update_binding to a value the algorithm
    does not output, unknown roles or bad ``ngdist.*`` metadata. Forward-only models pass."""
    if not model.training_info:
        return
    if len(model.training_info) > 1:
        raise GraphError(f"the model holds {len(model.training_info)} training_info entries; "
                         "ngdist trains with exactly one")
    info = model.training_info[0]
    if len(info.initialization.node) or len(info.initialization_binding):
        raise GraphError("training_info[0] has an initialization graph, which ngdist does not "
                         "run; initialize the state as initializers of the algorithm graph")
    alg = info.algorithm
    if not alg.node:
        raise GraphError("training_info[0].algorithm has no nodes: the training step is empty")
    main_inits = {t.name for t in model.graph.initializer}
    alg_inits = {t.name for t in alg.initializer}
    inputs = {i.name for i in alg.input}
    inits = main_inits | alg_inits
    data_inputs = inputs - inits  # what a batch feeds
    defined = inits | inputs
    defined |= _check_nodes(alg, defined, alg_inits | inputs)
    for inp in alg.input:
        elem = inp.type.tensor_type.elem_type
        if inp.name in data_inputs and elem not in NUMPY_TYPES:
            raise GraphError(f"the training step's data input {inp.name!r} has element type "
                             f"{_type_name(elem)}; ngdist feeds tensors of the types {_numpy_type_names()}")
    outputs = [o.name for o in alg.output]
    if not outputs:
        raise GraphError("training_info[0].algorithm has no outputs (the loss comes first)")
    undefined = [o for o in outputs if o not in defined]
    if undefined:
        raise GraphError(f"algorithm outputs {undefined} are produced by no node of the step")
    _check_bindings(model, inits, outputs, data_inputs)
    props = {p.key: p.value for p in model.metadata_props}
    if "ngdist.roles" in props:
        _check_roles(props["ngdist.roles"], defined, main_inits)
    loss = props.get("ngdist.loss")
    if loss is not None and loss not in outputs:
        raise GraphError(f"metadata ngdist.loss names {loss!r}, which is not an output of the "
                         f"algorithm graph (its outputs: {_listing(outputs)})")


def _check_nodes(alg: onnx.GraphProto, defined: set[str], given: set[str]) -> set[str]:
    """The values the algorithm's nodes produce, each once and none of ``given`` (its inputs
    and initializers); every node reads only what is ``defined`` or produced."""
    produced: set[str] = set()
    for idx, node in enumerate(alg.node):
        for out in node.output:
            if not out:
                continue
            if out in produced or out in given:
                raise GraphError(f"algorithm node {node.name or idx!r} ({node.op_type}) "
                                 f"defines {out!r} a second time")
            produced.add(out)
    defined = defined | produced
    for idx, node in enumerate(alg.node):
        missing = [i for i in node.input if i and i not in defined]
        if missing:
            raise GraphError(f"algorithm node {node.name or idx!r} ({node.op_type}) reads "
                             f"{missing}, which no input, initializer or node of the training "
                             "step defines")
        if node.domain == PREVIEW_TRAINING and node.op_type in _ALL_INPUTS_REQUIRED:
            empty = [k for k, i in enumerate(node.input) if not i]
            if empty:
                raise GraphError(f"algorithm node {node.name or idx!r} ({node.op_type}) has "
                                 f"empty inputs at positions {empty}; every input of "
                                 f"{PREVIEW_TRAINING}.{node.op_type} is required")
    return produced


def _check_bindings(model: onnx.ModelProto, inits: set[str], outputs: list[str],
                    data_inputs: set[str]) -> None:
    """update_binding: once each, initializers of a type ngdist holds, each to an output of
    the algorithm that is not a data input."""
    info = model.training_info[0]
    alg = info.algorithm
    keys = [kv.key for kv in info.update_binding]
    if not keys:
        raise GraphError("training_info[0].update_binding is empty: the step updates nothing")
    twice = sorted(k for k, n in Counter(keys).items() if n > 1)
    if twice:
        raise GraphError(f"update_binding binds {twice} more than once")
    unknown = [k for k in keys if k not in inits]
    if unknown:
        raise GraphError(f"update_binding names {unknown}, which are initializers of neither "
                         "the main graph nor the algorithm graph")
    tensors = {t.name: t for t in [*model.graph.initializer, *alg.initializer]}
    odd = {k: _type_name(tensors[k].data_type) for k in keys
           if tensors[k].data_type not in NUMPY_TYPES}
    if odd:
        raise GraphError(f"update_binding names {odd}: ngdist updates tensors of the types "
                         f"{_numpy_type_names()}")
    held = {t.name: _type_name(t.data_type) for t in tensors.values()
            if t.data_type not in NUMPY_TYPES}
    if held:
        raise GraphError(f"the training step holds the initializers {held}; ngdist holds "
                         f"tensors of the types {_numpy_type_names()}")
    bad = {kv.key: kv.value for kv in info.update_binding if kv.value not in outputs}
    if bad:
        raise GraphError(f"update_binding maps {bad} to values that are not outputs of the "
                         f"algorithm graph (its outputs: {_listing(outputs)})")
    fed = {kv.key: kv.value for kv in info.update_binding if kv.value in data_inputs}
    if fed:
        raise GraphError(f"update_binding maps {fed} to data inputs of the step, which a batch "
                         "feeds, not values the step computes; bind each to the output of its "
                         "update")


def _listing(names: list[str], limit: int = 8) -> str:
    return f"{names[:limit]}{' ...' if len(names) > limit else ''}"


def _check_roles(raw: str, defined: set[str], main_inits: set[str]) -> None:
    """``ngdist.roles``: a JSON object of known roles naming values of the step."""
    try:
        roles = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested too deep
        raise GraphError(f"metadata ngdist.roles is not valid JSON ({exc})") from None
    if not isinstance(roles, dict) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in roles.items()):
        raise GraphError("metadata ngdist.roles must be a JSON object of name -> role")
    wrong = {k: v for k, v in roles.items() if v not in ROLES}
    if wrong:
        raise GraphError(f"metadata ngdist.roles gives unknown roles {wrong}; roles are "
                         f"{', '.join(ROLES)}")
    absent = [k for k in roles if k not in defined]
    if absent:
        raise GraphError(f"metadata ngdist.roles names {absent}, which are not values of "
                         "the training step")
    misplaced = [k for k, v in roles.items()
                 if v in MODEL_LEVEL and k not in main_inits]
    if misplaced:
        raise GraphError(f"metadata ngdist.roles makes {misplaced} parameters or buffers, "
                         "but they are not initializers of the main graph")
