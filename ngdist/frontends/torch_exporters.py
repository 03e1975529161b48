"""The two ``torch.onnx`` exporters behind the PyTorch frontend, and the fallback between them.

The TorchScript exporter (``dynamo=False``) is tried first: it keeps training-mode
BatchNormalization (batch statistics and the running-statistics update), which the dynamo
exporter of torch 2.13 drops from a training-mode graph altogether (measured: a
Linear-BatchNorm1d-Dropout-Linear module exports as Gemm, Dropout, Gemm). Where the TorchScript
exporter fails (an operator without a symbolic, e.g. ``aten::histc`` in a mixture-of-experts
router), the dynamo exporter (``torch.export``) is tried, and the other way round when the
dynamo exporter is asked for first; the one used is logged. A module with running
statistics is not handed to the dynamo exporter. When neither can export, one GraphError
carries both exporters' messages. The TorchScript exporter is lent ngdist's symbolics for the
aten operators it lacks (frontends/torch_symbolics.py) for the export's duration; the source
lines of its TracerWarnings that say a tensor became a Python value are noted on the graph
(metadata ``CONVERSIONS_KEY``) for frontends/torch_trace_check.py.

The dynamo export runs without onnxscript's graph optimizer (``optimize=False``): the optimizer
merges initializers of equal value (two fresh LayerNorms' weights become one tensor) and folds
computations on parameters into new constants, and either would leave parameters untrained.
"""
from __future__ import annotations

import io
import logging
import re
import warnings
from collections.abc import Sequence
from typing import Any

import onnx

from ngdist.errors import ArgumentError, GraphError
from ngdist.frontends.renames import rename_graph
from ngdist.frontends.torch_attention import sdpa_export
from ngdist.frontends.torch_buffers import appended_outputs
from ngdist.frontends.torch_stop_gradient import mark_stop_gradients, no_grad_detached
from ngdist.frontends.torch_symbolics import dynamo_translations, lent_symbolics

logger = logging.getLogger(__name__)

EXPORTERS = ("torchscript", "dynamo")
CONVERSIONS_KEY = "ngdist.tensor_to_python"  # metadata: where the tracer made data Python values
_CONVERSION = re.compile(r"Converting a tensor to|Iterating over a tensor|registered as constants")
MESSAGE_CHARS = 400  # of each exporter's message in the combined error


def _torchscript(module: Any, args: tuple[Any, ...], training: bool, input_names: list[str],
                 output_names: list[str], opset: int) -> onnx.ModelProto:
    import torch

    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    dynamic = {**_leading_names(args, input_names), **{n: {0: "batch"} for n in output_names}}
    buf = io.BytesIO()
    with warnings.catch_warnings(record=True) as seen, sdpa_export(opset), \
            lent_symbolics(opset), no_grad_detached():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("always", torch.jit.TracerWarning)  # recorded, not shown
        torch.onnx.export(module, args, buf, dynamo=False, training=mode,
                          do_constant_folding=False, opset_version=opset,
                          input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic, keep_initializers_as_inputs=False)
    model = onnx.load_from_string(buf.getvalue())
    _note_conversions(model, seen)  # checked by frontends/torch_trace_check.py
    mark_stop_gradients(model)
    return model


def _note_conversions(model: onnx.ModelProto, seen: Sequence[Any]) -> None:
    """Notes on ``model`` the ``file:line`` of each recorded TracerWarning that says a tensor
    became a Python value (``seen``: ``warnings.catch_warnings(record=True)``'s list)."""
    sites = sorted({f"{w.filename}:{w.lineno}" for w in seen
                    if w.category.__name__ == "TracerWarning"
                    and _CONVERSION.search(str(w.message))})
    if sites:
        model.metadata_props.add(key=CONVERSIONS_KEY, value="\n".join(sites))


def _leading_names(args: tuple[Any, ...], input_names: list[str]) -> dict[str, dict[int, str]]:
    """Axis 0 of each input: "batch" where its example has the first input's rows, a name of
    its own where not (labels of k rows per sample): inputs declared to share a size are taken
    to by onnxruntime, whose memory planner then reuses one's buffer for the other's."""
    rows = [getattr(a, "shape", (None,))[0] if getattr(a, "ndim", 0) else None for a in args]
    return {n: {0: "batch" if r == rows[0] else f"{n}_rows"}
            for n, r in zip(input_names, rows)}


def _running_statistics(module: Any) -> str | None:
    """Why the dynamo exporter cannot take ``module`` (None: it can)."""
    import torch

    norms = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)
    for name, sub in module.named_modules():
        if isinstance(sub, norms) and sub.track_running_stats:
            return (f"{type(sub).__name__} '{name}' keeps running statistics, which the dynamo "
                    "exporter drops from a training-mode graph")
    return None


def _dynamo(module: Any, args: tuple[Any, ...], training: bool, input_names: list[str],
            output_names: list[str], opset: int) -> onnx.ModelProto:
    import torch

    reason = _running_statistics(module)
    if reason is not None:
        raise GraphError(reason)
    module.train(training)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamic_shapes=_leading_dims(module, args),
                                    dynamo=True, opset_version=opset, input_names=input_names,
                                    output_names=output_names, optimize=False, verbose=False,
                                    custom_translation_table=dynamo_translations())
    model = program.model_proto
    mark_stop_gradients(model)
    return model


def _leading_dims(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Axis 0 of every input dynamic, each on its own (``Dim.AUTO``: torch.export relates
    them only where the model does, so labels of k rows per sample keep their own size); a
    ``forward(*args)`` takes the tuple as its one argument."""
    import inspect

    import torch

    dims = tuple({0: torch.export.Dim.AUTO} for _ in args)
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return (dims,)
    return dims


_EXPORT = {"torchscript": _torchscript, "dynamo": _dynamo}


def export_graph(exporter: str, module: Any, args: tuple[Any, ...], training: bool,
                 input_names: list[str], output_names: list[str], opset: int
                 ) -> onnx.ModelProto:
    """``module`` in training or eval mode, by the named exporter."""
    return _EXPORT[exporter](module, args, training, input_names, output_names, opset)


def _summary(exc: BaseException) -> str:
    """The root cause of an exporter's failure in a line or two (torch.export wraps it in a
    TorchExportError whose own text is generic advice)."""
    while exc.__cause__ is not None and str(exc.__cause__).strip():
        exc = exc.__cause__
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines()]
    text = " ".join(ln for ln in lines[:2] if ln)
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3] + "..."


def export_training(module: Any, args: tuple[Any, ...], input_names: list[str],
                    output_names: list[str], opset: int, first: str = "torchscript",
                    appended: Sequence[str] = ()) -> tuple[str, onnx.ModelProto]:
    """(the exporter that worked, the training-mode graph): ``first``, then the other one.
    ``appended``: buffers whose values after the forward are the graph's last outputs."""
    if first not in EXPORTERS:
        raise ArgumentError(f"exporter must be one of {EXPORTERS}; got {first!r}")
    order = [first, *(e for e in EXPORTERS if e != first)]
    failures: list[str] = []
    for exporter in order:
        try:
            with appended_outputs(module, appended):
                model = export_graph(exporter, module, args, True, input_names, output_names,
                                     opset)
        except Exception as exc:  # noqa: BLE001 - any exporter failure: try the other one
            failures.append(f"the {exporter} exporter: {_summary(exc)}")
            logger.info("the %s exporter could not export %s: %s", exporter,
                        type(module).__name__, exc)
            continue
        if failures:
            logger.warning("exported %s with the %s exporter (%s)", type(module).__name__,
                           exporter, failures[0])
        else:
            logger.info("exported %s with the %s exporter", type(module).__name__, exporter)
        return exporter, model
    raise GraphError(f"torch.onnx.export cannot export {type(module).__name__}: "
                     + "; ".join(failures) + ". Rewrite the unsupported operation or compile an "
                     "ONNX file you exported yourself")


def tied_aliases(module: Any) -> dict[str, str]:
    """state_dict name -> the name ``named_parameters()``/``named_buffers()`` give the same
    tensor, for the names of a tied tensor other than its own (Hugging Face ties a decoder's
    ``proj_out.weight`` to ``embed_tokens.weight``; the dynamo exporter names the initializer
    by the alias, which no parameter of the module has)."""
    owner: dict[int, str] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        owner.setdefault(id(tensor), name)
    return {k: owner[id(v)] for k, v in module.state_dict(keep_vars=True).items()
            if id(v) in owner and owner[id(v)] != k}


def rename_aliases(model: onnx.ModelProto, aliases: dict[str, str]) -> None:
    """Initializers named by an alias take the tensor's own name (unless that name is an
    initializer too), and so do the node inputs that read them."""
    names = {t.name for t in model.graph.initializer}
    rename_graph(model.graph, {a: n for a, n in aliases.items() if a in names and n not in names})

