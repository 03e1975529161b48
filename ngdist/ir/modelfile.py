"""Reading model files safely: regular files only, a size limit, external data confined to the
model's folder.

* ``read_model_bytes(path)``: ``os.stat`` first, so a directory, a FIFO (which would block an
  ``open``) or a device such as ``/dev/zero`` is refused before anything is opened; a file
  larger than the limit (``NGDIST_MAX_MODEL_BYTES``, default 2 GiB, protobuf's own limit) is
  refused before it is read.
* ``resolve_external_data(model, folder)``: every tensor stored with
  ``data_location=EXTERNAL`` (``onnx.save(..., save_as_external_data=True)``) gets its bytes
  from a regular file inside the model's folder, and is then an ordinary in-file tensor; so a
  model saved again holds its own bytes, never bytes of a file outside that folder. A location
  that is absolute, holds ``..`` or passes through a symbolic link (directory or file) is
  refused, as is an offset or length beyond the end of the file or a length other than the
  tensor's size.
"""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from onnx import TensorProto, numpy_helper

from ngdist.errors import ModelLoadError

MAX_BYTES_ENV = "NGDIST_MAX_MODEL_BYTES"
DEFAULT_MAX_BYTES = 2 ** 31  # protobuf cannot parse a message of 2 GiB or more
MAX_DIMS = 64  # numpy's NPY_MAXDIMS (2.x) and the most an onnxruntime tensor is given here

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def max_model_bytes() -> int:
    """The largest model file ngdist reads: ``NGDIST_MAX_MODEL_BYTES`` or 2 GiB."""
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ModelLoadError(f"{MAX_BYTES_ENV}={raw!r} is not a positive number of bytes; "
                             f"set it to e.g. {DEFAULT_MAX_BYTES} or unset it")
    return value


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse_irregular(where: str, mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise ModelLoadError(f"{where}: is {_kind(mode)}, not a regular file; {what}")


def read_model_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of the model file ``path``, checked to be a regular file within the limit."""
    limit = max_model_bytes()
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: {exc.strerror}") from None
    _refuse_irregular(str(path), info.st_mode, "give the path of an .onnx file")
    _refuse_too_large(path, info.st_size, limit)
    try:
        # O_NONBLOCK: were the file swapped for a FIFO since the stat, open would not block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ModelLoadError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        _refuse_irregular(str(path), info.st_mode, "give the path of an .onnx file")
        data = fh.read(limit + 1)
    _refuse_too_large(path, len(data), limit)
    return data


def _refuse_too_large(path: str | os.PathLike, size: int, limit: int) -> None:
    if size > limit:
        raise ModelLoadError(
            f"{path}: {size:,} bytes, more than the limit of {limit:,} bytes; store large "
            f"weights as external data (onnx.save(..., save_as_external_data=True)) or raise "
            f"the limit with {MAX_BYTES_ENV}")


# --------------------------------------------------------------------------- external data

def iter_graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph, the training_info graphs and every subgraph of theirs at any depth
    (no recursion, so a deeply nested model cannot exhaust the stack)."""
    graphs = [model.graph]
    for info in model.training_info:
        graphs += [info.algorithm, info.initialization]
    while graphs:
        graph = graphs.pop()
        yield graph
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)


def check_nodes(model: onnx.ModelProto, where: str) -> None:
    """Every node of every graph names its op and every attribute has a name and a type
    (onnx's checker passes nodes of domains it has no schema for, and training_info's), and
    every value's declared element type is one ONNX defines; a graph's inputs and outputs (fed
    and returned as numpy arrays) have at most ``MAX_DIMS`` dimensions (onnxruntime runs
    intermediate values of more)."""
    for graph in iter_graphs(model):
        for idx, node in enumerate(graph.node):
            what = f"{where}: node {node.name or idx!r} of graph {graph.name!r}"
            if not node.op_type:
                raise ModelLoadError(f"{what} has no op type; the file is damaged")
            for attr in node.attribute:
                if not attr.name or attr.type == onnx.AttributeProto.UNDEFINED:
                    raise ModelLoadError(f"{what} ({node.op_type}) has an attribute without "
                                         f"{'a name' if not attr.name else 'a type'} "
                                         f"({attr.name!r}); the file is damaged")
        for value in [*graph.input, *graph.output, *graph.value_info]:
            bad = _unknown_elem_type(value.type)
            if bad is not None:
                raise ModelLoadError(f"{where}: value {value.name!r} of graph {graph.name!r} has "
                                     f"the unknown element type {bad}; the file is damaged")
        for value in [*graph.input, *graph.output]:  # what a caller feeds and gets as arrays
            rank = max((len(t.shape.dim) for t in _tensor_types(value.type)), default=0)
            if rank > MAX_DIMS:
                raise _too_many_dims(f"{where}: value {value.name!r} of graph {graph.name!r}",
                                     rank)


def _tensor_types(tp: onnx.TypeProto) -> Iterator[onnx.TypeProto.Tensor]:
    """The tensor types in ``tp``: itself, and those inside sequences, optionals and maps."""
    stack = [tp]
    while stack:
        t = stack.pop()
        kind = t.WhichOneof("value")
        if kind in ("tensor_type", "sparse_tensor_type"):
            yield getattr(t, kind)
        elif kind in ("sequence_type", "optional_type"):
            stack.append(getattr(t, kind).elem_type)
        elif kind == "map_type":
            stack.append(t.map_type.value_type)


def _unknown_elem_type(tp: onnx.TypeProto) -> int | None:
    """An element type in ``tp`` that ONNX does not define, else None; 0 (unset) is allowed."""
    for tensor in _tensor_types(tp):
        if tensor.elem_type and tensor.elem_type not in _KNOWN_TYPES:
            return tensor.elem_type
    return None


def _too_many_dims(what: str, rank: int) -> ModelLoadError:
    return ModelLoadError(f"{what} has {rank} dimensions; numpy and onnxruntime hold at most "
                          f"{MAX_DIMS}: re-export the model with tensors of at most {MAX_DIMS}")


def iter_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of the model: initializers (sparse ones too) and tensor attributes of
    every graph (:func:`iter_graphs`)."""
    for graph in iter_graphs(model):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                for sparse in attr.sparse_tensors:
                    yield sparse.values
                    yield sparse.indices


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in iter_tensors(model) if t.data_location == TensorProto.EXTERNAL]


def refuse_external_data(model: onnx.ModelProto) -> None:
    """A ModelProto given in memory whose tensors still point at external files: ngdist does
    not know the folder those files are relative to, so it does not guess."""
    pending = external_tensors(model)
    if pending:
        names = [t.name for t in pending[:5]]
        raise ModelLoadError(
            f"tensors {names}{' ...' if len(pending) > 5 else ''} of the model are stored in "
            "external data files that were not read; pass the model's path (ngdist reads the "
            "external data from the model's folder) or load it with onnx.load(path) first")


def _tensor_bytes(tensor: onnx.TensorProto) -> int | None:
    """The byte size of the tensor's raw data from its element type and dims, None when the
    type has no fixed size (STRING, UNDEFINED or an unknown type)."""
    count = 1
    for d in tensor.dims:
        count *= d
    if tensor.data_type in (TensorProto.INT4, TensorProto.UINT4,
                            getattr(TensorProto, "FLOAT4E2M1", -1)):
        return (count + 1) // 2
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    if tensor.data_type == TensorProto.STRING:
        return None
    return count * int(itemsize)


def _open_inside(folder: Path, location: str, where: str) -> int:
    """A read-only descriptor of the regular file ``location`` under ``folder``; refuses an
    absolute path, ``..`` and any symbolic link on the way (checked with ``lstat`` and opened
    with ``O_NOFOLLOW`` component by component, so nothing can be swapped in between)."""
    if "\0" in location or not location.strip():
        raise ModelLoadError(f"{where}: the external data location {location!r} is not a "
                             "file name")
    if os.path.isabs(location) or location.startswith(("\\", "/")) or \
            (len(location) > 1 and location[1] == ":"):
        raise ModelLoadError(f"{where}: the external data location {location!r} is an absolute "
                             "path; ngdist reads external data only from files inside the "
                             "model's folder, named relative to it")
    parts = [p for p in location.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ModelLoadError(f"{where}: the external data location {location!r} leads out of "
                             "the model's folder ('..'); keep the data file next to the model")
    if not parts:
        raise ModelLoadError(f"{where}: the external data location {location!r} is not a "
                             "file name")
    nofollow = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ModelLoadError(f"{where}: the model's folder {folder} cannot be read "
                             f"({exc.strerror})") from None
    try:
        for i, part in enumerate(parts):
            shown = "/".join(parts[:i + 1])
            try:
                mode = os.lstat(part, dir_fd=fd).st_mode
            except FileNotFoundError:
                raise ModelLoadError(f"{where}: its external data file {shown!r} does not "
                                     f"exist in the model's folder {folder}") from None
            except OSError as exc:
                raise ModelLoadError(f"{where}: its external data file {shown!r} cannot be "
                                     f"read ({exc.strerror})") from None
            if stat.S_ISLNK(mode):
                raise ModelLoadError(f"{where}: the external data location {location!r} "
                                     f"passes through the symbolic link {shown!r}; ngdist "
                                     "follows no links out of the model's folder: copy the "
                                     "data file next to the model")
            last = i == len(parts) - 1
            if not last and not stat.S_ISDIR(mode):
                raise ModelLoadError(f"{where}: {shown!r} in the external data location "
                                     f"{location!r} is not a folder")
            if last:
                _refuse_irregular(f"{where}: its external data file {shown!r}", mode,
                                  "external data must be a regular file")
            flags = os.O_RDONLY | nofollow | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                reason = ("it was replaced by a symbolic link" if exc.errno in
                          (errno.ELOOP, errno.ENOTDIR) else exc.strerror)
                raise ModelLoadError(f"{where}: its external data file {shown!r} cannot be "
                                     f"read ({reason})") from None
            os.close(fd)
            fd = nxt
        info = os.fstat(fd)
        _refuse_irregular(f"{where}: its external data file {location!r}", info.st_mode,
                          "external data must be a regular file")
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_text(model: onnx.ModelProto, where: str) -> None:
    """Every string field of the model (names, op types, metadata...) is UTF-8 text.
    protobuf hands a field that is not as ``bytes``, which nothing downstream expects."""
    stack: list[Message] = [model]
    while stack:
        msg = stack.pop()
        for desc, value in msg.ListFields():
            if desc.type == FieldDescriptor.TYPE_MESSAGE:
                if _is_repeated(desc):
                    stack.extend(value)
                else:
                    stack.append(value)
            elif desc.type == FieldDescriptor.TYPE_STRING:
                for item in (value if _is_repeated(desc) else (value,)):
                    if not isinstance(item, str):
                        raise ModelLoadError(
                            f"{where}: the {type(msg).__name__} field {desc.name!r} holds "
                            f"{bytes(item)[:40]!r}, which is not UTF-8 text; the file is "
                            "damaged or was not written by an ONNX exporter")


def _is_repeated(desc: FieldDescriptor) -> bool:
    repeated = getattr(desc, "is_repeated", None)  # protobuf >= 5.29
    return bool(repeated) if repeated is not None else \
        desc.label == FieldDescriptor.LABEL_REPEATED


def check_tensor_data(model: onnx.ModelProto, where: str) -> None:
    """Every tensor has at most ``MAX_DIMS`` dimensions and its data fit its element type and
    dims (raw bytes by their size, typed fields by decoding them), so that no later step meets
    a tensor it cannot read."""
    for tensor in iter_tensors(model):
        what = f"{where}: tensor {tensor.name!r}"
        if len(tensor.dims) > MAX_DIMS:
            raise _too_many_dims(what, len(tensor.dims))
        if any(d < 0 for d in tensor.dims):
            raise ModelLoadError(f"{what} has negative dims {list(tensor.dims)}")
        if tensor.data_location == TensorProto.EXTERNAL:
            continue
        if tensor.data_type not in _KNOWN_TYPES:
            raise ModelLoadError(f"{what} has the unknown element type {tensor.data_type}")
        if tensor.HasField("raw_data"):
            expected = _tensor_bytes(tensor)
            if expected is None:  # STRING: ONNX keeps strings in string_data, never raw
                raise ModelLoadError(
                    f"{what} of type {TensorProto.DataType.Name(tensor.data_type)} holds raw "
                    "bytes, which ONNX allows only for fixed-size types; the file is damaged")
            if len(tensor.raw_data) != expected:
                raise ModelLoadError(
                    f"{what}: {len(tensor.raw_data):,} bytes of data, but its type "
                    f"{TensorProto.DataType.Name(tensor.data_type)} and dims "
                    f"{list(tensor.dims)} need {expected:,} bytes")
            continue
        try:
            numpy_helper.to_array(tensor)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - numpy/onnx raise several kinds here
            raise ModelLoadError(f"{what}: its data do not fit its type and dims "
                                 f"{list(tensor.dims)} ({exc})") from None


_KNOWN_TYPES = frozenset(v for k, v in TensorProto.DataType.items() if k != "UNDEFINED")


def _int_field(value: str, key: str, where: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ModelLoadError(f"{where}: external data {key}={value!r} is not a non-negative "
                             "integer")
    return number


def resolve_external_data(model: onnx.ModelProto, folder: str | os.PathLike,
                          path: str | os.PathLike) -> None:
    """Reads every external tensor's bytes from its file under ``folder`` (the model's folder)
    into the tensor itself; ``path`` (the model file) names the model in errors."""
    folder = Path(folder)
    for tensor in external_tensors(model):
        where = f"{path}: tensor {tensor.name!r}"
        fields = {e.key: e.value for e in tensor.external_data}
        if "location" not in fields:
            raise ModelLoadError(f"{where}: stored externally but names no location")
        if tensor.data_type == TensorProto.STRING:
            raise ModelLoadError(f"{where}: a STRING tensor cannot be stored as external data")
        offset = _int_field(fields.get("offset", "0"), "offset", where)
        length = (_int_field(fields["length"], "length", where) if "length" in fields else None)
        fd = _open_inside(folder, fields["location"], where)
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if length is None:
                length = max(size - offset, 0)
            expected = _tensor_bytes(tensor)
            if expected is not None and length != expected:
                raise ModelLoadError(
                    f"{where}: external data of {length:,} bytes, but its type and shape "
                    f"{list(tensor.dims)} need {expected:,} bytes")
            if offset + length > size:
                raise ModelLoadError(
                    f"{where}: external data at offset {offset:,} + length {length:,} lies "
                    f"beyond the end of {fields['location']!r} ({size:,} bytes); the data file "
                    "is truncated or belongs to another model")
            fh.seek(offset)
            data = fh.read(length)
        if len(data) != length:
            raise ModelLoadError(f"{where}: {fields['location']!r} ended after {len(data):,} "
                                 f"of {length:,} bytes; the data file is truncated")
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.ClearField("data_location")  # as a tensor saved without external data


__all__ = ["DEFAULT_MAX_BYTES", "MAX_BYTES_ENV", "MAX_DIMS", "check_nodes", "check_tensor_data",
           "check_text", "iter_graphs", "iter_tensors", "max_model_bytes",
           "read_model_bytes", "refuse_external_data", "resolve_external_data"]
