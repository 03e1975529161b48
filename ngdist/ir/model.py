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
import errno
import json
import logging
import os
import re
import secrets
import socket
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from ngdist.errors import GraphError, ModelLoadError
from ngdist.ir.domain import DOMAIN, DOMAIN_VERSION
from ngdist.ir.modelfile import (check_nodes, check_tensor_data, check_text, read_model_bytes,
                                 resolve_external_data)

logger = logging.getLogger(__name__)

IR_VERSION = 10  # onnxruntime 1.31 reads at most 13; onnx 1.23 would write 14
ROLES = ("data", "param", "buffer", "state", "hyper")
MODEL_LEVEL = ("param", "buffer")  # roles whose values live in model.graph.initializer
# element types of the values a step is fed or updates (held as numpy arrays and OrtValues)
NUMPY_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                         TensorProto.BFLOAT16, TensorProto.INT64, TensorProto.INT32,
                         TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16,
                         TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
                         TensorProto.BOOL})
_TYPE_NAMES = frozenset(TensorProto.DataType.values())


def _numpy_type_names() -> str:
    return ", ".join(sorted(TensorProto.DataType.Name(t) for t in NUMPY_TYPES))


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
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError, RuntimeError, RecursionError,
            UnicodeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"{where}: the ONNX model is invalid ({first}); the file may be "
                             "truncated or produced by a broken exporter") from None
    try:
        check_training_model(model)
    except GraphError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


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
    defined = main_inits | alg_inits | inputs
    produced: set[str] = set()
    for idx, node in enumerate(alg.node):
        for out in node.output:
            if not out:
                continue
            if out in produced or out in alg_inits or out in inputs:
                raise GraphError(f"algorithm node {node.name or idx!r} ({node.op_type}) "
                                 f"defines {out!r} a second time")
            produced.add(out)
    defined |= produced
    for idx, node in enumerate(alg.node):
        missing = [i for i in node.input if i and i not in defined]
        if missing:
            raise GraphError(f"algorithm node {node.name or idx!r} ({node.op_type}) reads "
                             f"{missing}, which no input, initializer or node of the training "
                             "step defines")
    for inp in alg.input:
        elem = inp.type.tensor_type.elem_type
        if inp.name not in main_inits | alg_inits and elem not in NUMPY_TYPES:
            shown = TensorProto.DataType.Name(elem) if elem in _TYPE_NAMES else elem
            raise GraphError(f"the training step's data input {inp.name!r} has element type "
                             f"{shown}; ngdist feeds tensors of the types {_numpy_type_names()}")
    outputs = [o.name for o in alg.output]
    if not outputs:
        raise GraphError("training_info[0].algorithm has no outputs (the loss comes first)")
    undefined = [o for o in outputs if o not in defined]
    if undefined:
        raise GraphError(f"algorithm outputs {undefined} are produced by no node of the step")
    keys = [kv.key for kv in info.update_binding]
    if not keys:
        raise GraphError("training_info[0].update_binding is empty: the step updates nothing")
    twice = sorted(k for k, n in Counter(keys).items() if n > 1)
    if twice:
        raise GraphError(f"update_binding binds {twice} more than once")
    unknown = [k for k in keys if k not in main_inits | alg_inits]
    if unknown:
        raise GraphError(f"update_binding names {unknown}, which are initializers of neither "
                         "the main graph nor the algorithm graph")
    tensors = {t.name: t for t in [*model.graph.initializer, *alg.initializer]}
    odd = {k: TensorProto.DataType.Name(tensors[k].data_type) if tensors[k].data_type in
           _TYPE_NAMES else tensors[k].data_type for k in keys
           if tensors[k].data_type not in NUMPY_TYPES}
    if odd:
        raise GraphError(f"update_binding names {odd}: ngdist updates tensors of the types "
                         f"{_numpy_type_names()}")
    held = {t.name: t.data_type for t in tensors.values() if t.data_type not in NUMPY_TYPES}
    if held:
        shown = {k: TensorProto.DataType.Name(v) if v in _TYPE_NAMES else v
                 for k, v in held.items()}
        raise GraphError(f"the training step holds the initializers {shown}; ngdist holds "
                         f"tensors of the types {_numpy_type_names()}")
    bad = {kv.key: kv.value for kv in info.update_binding if kv.value not in outputs}
    if bad:
        raise GraphError(f"update_binding maps {bad} to values that are not outputs of the "
                         f"algorithm graph (its outputs: {_listing(outputs)})")
    fed = {kv.key: kv.value for kv in info.update_binding
           if kv.value in inputs and kv.value not in main_inits | alg_inits}
    if fed:
        raise GraphError(f"update_binding maps {fed} to data inputs of the step, which a batch "
                         "feeds, not values the step computes; bind each to the output of its "
                         "update")
    props = {p.key: p.value for p in model.metadata_props}
    if "ngdist.roles" in props:
        _check_roles(props["ngdist.roles"], defined, main_inits)
    loss = props.get("ngdist.loss")
    if loss is not None and loss not in outputs:
        raise GraphError(f"metadata ngdist.loss names {loss!r}, which is not an output of the "
                         f"algorithm graph (its outputs: {_listing(outputs)})")


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


_TMP_MARK = ".ngdist-tmp-"  # .<name>.ngdist-tmp-<pid>-<host>-<random>: a save in progress


def _tmp_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(f".{name}{_TMP_MARK}") + r"(\d+)-(.*)-[0-9a-f]{8}")


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _host() -> str:
    """This host's name as temporary file names carry it."""
    return socket.gethostname().split(".")[0].replace("/", "_")[:32] or "localhost"


def _remove_stale_temps(path: Path, host: str) -> None:
    """Delete the temporary files that saves of ``path`` killed on this host left behind
    (their process no longer runs); those of other hosts sharing the folder are left alone."""
    pattern = _tmp_pattern(path.name)
    try:
        entries = os.listdir(path.parent)
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match and match.group(2) == host and not _process_runs(int(match.group(1))):
            try:
                (path.parent / entry).unlink()
                logger.info("removed %s, left behind by an interrupted save", path.parent / entry)
            except OSError:  # removed meanwhile, or not ours to remove
                pass


def remove_stale_temps_in(folder: str | os.PathLike) -> None:
    """:func:`_remove_stale_temps` for every target in ``folder`` that has a temporary file
    (saves killed on this host whose target was never saved again)."""
    folder = Path(folder)
    host = _host()
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for target in {e[1:e.index(_TMP_MARK)] for e in entries
                   if e.startswith(".") and _TMP_MARK in e}:
        _remove_stale_temps(folder / target, host)


def save_proto(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` atomically (see :func:`write_atomic`)."""
    write_atomic(path, model.SerializeToString())


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` atomically: a temporary file in the same folder, then rename over it.

    A save killed at any point leaves the target as it was (or absent); the temporary file it
    leaves (``.<name>.ngdist-tmp-<pid>-<host>-<random>``) is removed by the next save of the
    same target once that process no longer runs. The file gets the permissions ``open()``
    gives: those of the file it replaces, else 0o666 less the umask. An OSError names ``path``.
    """
    path = Path(path)
    host = _host()
    tmp = path.parent / f".{path.name}{_TMP_MARK}{os.getpid()}-{host}-{secrets.token_hex(4)}"
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where the folder should be
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None
        _remove_stale_temps(path, host)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode) if path.is_file() else None
        except OSError:
            mode = None
        # created like open() creates a file: 0o666, less the umask (applied by the system)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as fh:
                if mode is not None:
                    os.fchmod(fh.fileno(), mode)
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        if exc.errno is None or exc.filename == str(path):
            raise
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
    try:  # the rename itself survives a crash of the machine
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    logger.info("wrote %s (%d bytes)", path, path.stat().st_size)


# --------------------------------------------------------------------------- split / assemble

def _used_names(graph: onnx.GraphProto) -> set[str]:
    return {i for n in graph.node for i in n.input if i} | {o.name for o in graph.output}


def split_training_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, ir.Model]:
    """ModelProto with training_info -> (inference model, step graph as onnx_ir model)."""
    check_training_model(model)
    if not model.training_info:
        raise GraphError(
            "the model has no training_info: it is a forward-only model. Build a training "
            "model with ngdist.compile(..., loss=..., optimizer=...) or `ngdist rewrite "
            "--loss ... --optimizer ...`")
    info = model.training_info[0]
    alg = copy.deepcopy(info.algorithm)
    binding = {kv.key: kv.value for kv in info.update_binding}
    props = {p.key: p.value for p in model.metadata_props}
    stored_roles = json.loads(props.get("ngdist.roles", "{}"))
    main_inits = {t.name: t for t in model.graph.initializer}
    alg_inits = {t.name: t for t in alg.initializer}
    used = _used_names(alg)

    roles: dict[str, str] = {}
    for inp in alg.input:
        if inp.name not in alg_inits and inp.name not in main_inits:
            roles[inp.name] = "data"
    for name in main_inits:
        if name in binding:
            roles[name] = stored_roles.get(name, "param")
    for name in alg_inits:
        roles[name] = stored_roles.get(name, "state" if name in binding else "hyper")
    missing = [k for k in binding if k not in roles]
    if missing:
        raise GraphError(f"update_binding names {missing}, which are initializers of neither "
                         "the main graph nor the algorithm graph")

    existing_inputs = {i.name for i in alg.input}
    # Everything the step reads from the main graph becomes a step input (if updated) or constant.
    for name, tensor in main_inits.items():
        if name not in used and name not in binding:
            continue
        alg.initializer.append(tensor)
        if name in binding and name not in existing_inputs:
            alg.input.append(onnx.helper.make_tensor_value_info(
                name, tensor.data_type, list(tensor.dims)))
    for name, tensor in alg_inits.items():
        if name not in existing_inputs:
            alg.input.append(onnx.helper.make_tensor_value_info(
                name, tensor.data_type, list(tensor.dims)))
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
    try:
        step_proto = onnx.shape_inference.infer_shapes(step_proto)
    except Exception as exc:  # shapes help the autodiff; they are not required
        logger.debug("shape inference of the step graph failed: %s", exc)
    step = ir.from_proto(step_proto)
    set_meta(step, StepMeta(roles, binding, loss))
    inference = copy.deepcopy(model)
    del inference.training_info[:]
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
