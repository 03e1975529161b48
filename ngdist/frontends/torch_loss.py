"""A torch loss exported together with the model it trains.

``loss=`` given to the torch frontend as a torch module or function (or any callable of
``(output, labels)``) is exported with the model: a wrapper module whose forward is
``loss(model(*inputs), labels)`` goes through the same exporters as the model
(frontends/torch_exporters.py), so whatever torch can export trains with torch's own formula
(``NLLLoss``, ``CrossEntropyLoss`` with ``weight``/``label_smoothing``/``ignore_index``,
``BCEWithLogitsLoss``, ``HuberLoss``, ``KLDivLoss``, a user's function). The training graph's
one output is the loss; the deployable graph stays the model's eval-mode export.

Two losses keep their built-in form (no second export): ``nn.CrossEntropyLoss()`` and
``nn.MSELoss()`` with their defaults (the labels of a built-in cross-entropy must be valid
classes, torch's ``ignore_index=-100`` never occurs), unless the model's output is already a
(log-)softmax, which torch's cross-entropy normalises again and the export reproduces.

The labels' example value, which the exporter needs, is zeros: class indices (int64, the
output's shape without its class axis) for the losses that take them, and the output's shape
and dtype otherwise; an unknown callable is tried with class indices first, then with
the output's shape. A mean over counted labels (``ignore_index``, class weights) exports as
ONNX ``SoftmaxCrossEntropyLoss``/``NegativeLogLikelihoodLoss`` with the attribute, which
passes/losscount.py divides by the global count on several ranks.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import onnx

from ngdist.errors import GraphError, OptionError
from ngdist.frontends.renames import rename_graph

logger = logging.getLogger(__name__)

LOSS_OUTPUT = "ngdist.loss"   # the training export's one output
MODEL = "ngdist_model"        # the wrapper's attribute holding the model (a state_dict prefix)
LOSS_FN = "ngdist_loss_fn"    # ... holding a loss module (its buffers: constants of the loss)
# torch losses whose labels are class indices (the rest take the output's shape)
INDEX_LOSSES = ("CrossEntropyLoss", "NLLLoss", "MultiMarginLoss", "cross_entropy", "nll_loss",
                "multi_margin_loss")
SHAPE_LOSSES = ("MSELoss", "L1Loss", "HuberLoss", "SmoothL1Loss", "BCELoss",
                "BCEWithLogitsLoss", "KLDivLoss", "SoftMarginLoss", "mse_loss", "l1_loss",
                "huber_loss", "smooth_l1_loss", "binary_cross_entropy",
                "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss")


def _name(loss: Any) -> str:
    return getattr(loss, "__name__", None) or type(loss).__name__


def builtin_name(loss: Any) -> str | None:
    """The ngdist loss string equal to ``loss`` (a string or None is returned as it is);
    None for a callable that is exported with the model."""
    if loss is None or isinstance(loss, str):
        return loss
    if not callable(loss):
        raise OptionError(f"loss= takes a loss name, None (the model's output is the loss), a "
                          f"torch loss module or a function of (output, labels); got "
                          f"{type(loss).__name__}")
    import torch.nn as nn

    if type(loss) is nn.CrossEntropyLoss and loss.weight is None and \
            loss.label_smoothing == 0.0 and loss.reduction == "mean" and \
            loss.ignore_index == -100:
        return "softmax_cross_entropy"
    if type(loss) is nn.MSELoss and loss.reduction == "mean":
        return "mse"
    return None


def exported(loss: Any) -> bool:
    """Whether ``loss`` is exported with the model (a callable without a built-in form)."""
    return loss is not None and not isinstance(loss, str) and builtin_name(loss) is None


def check_labels_name(labels: str, input_names: Sequence[str], output_names: Sequence[str]
                      ) -> None:
    """The labels input must not be named like an input or output of the model."""
    for kind, names in (("input", input_names), ("output", output_names)):
        if labels in names:
            raise GraphError(f"the labels input {labels!r} has the name of a model {kind} "
                             f"({kind}s: {list(names)}); pass labels= another name, e.g. "
                             f"labels='labels'")


def _forward(n: int) -> Any:
    """``forward(self, in0, ..., in{n-1}, labels)``: the exporters match named arguments
    (the dynamo exporter takes ``*args`` for one input)."""
    names = [f"in{i}" for i in range(n)]
    source = (f"def forward(self, {', '.join([*names, 'labels'])}):\n"
              f"    return self.compute(({', '.join(names)},), labels)\n")
    scope: dict[str, Any] = {}
    exec(source, scope)  # noqa: S102 - a fixed template; n is an int
    return scope["forward"]


def _wrapper(module: Any, loss: Any, n_inputs: int) -> Any:
    import torch.nn as nn

    class WithLoss(nn.Module):
        """forward(*inputs, labels) = (loss(module(*inputs), labels), module(*inputs))."""

        forward = _forward(n_inputs)

        def __init__(self) -> None:
            super().__init__()
            setattr(self, MODEL, module)
            if isinstance(loss, nn.Module):
                setattr(self, LOSS_FN, loss)
            else:
                object.__setattr__(self, LOSS_FN, loss)

        def compute(self, inputs: tuple[Any, ...], labels: Any) -> Any:
            out = getattr(self, MODEL)(*inputs)
            if isinstance(out, (tuple, list)):
                out = out[0]
            return getattr(self, LOSS_FN)(out, labels), out

    wrapper = WithLoss()
    wrapper.train(module.training)
    return wrapper


def smoothed_cross_entropy(loss: Any) -> Any:
    """``nn.CrossEntropyLoss`` with ``label_smoothing`` as plain ops, torch's formula
    (aten cross_entropy_loss_label_smoothing): the exporters drop or refuse the smoothing."""
    import torch
    import torch.nn.functional as F

    eps, ignore, weight, reduction = (loss.label_smoothing, loss.ignore_index, loss.weight,
                                      loss.reduction)

    def smoothed(output: Any, labels: Any) -> Any:
        logp = F.log_softmax(output, dim=1)
        nll = F.nll_loss(logp, labels, weight=weight, ignore_index=ignore, reduction=reduction)
        shape = [1, -1, *([1] * (logp.dim() - 2))]
        terms = logp if weight is None else logp * weight.reshape(shape)
        keep = (labels != ignore).to(logp.dtype)
        smooth = -terms.sum(dim=1) * keep
        if reduction == "sum":
            smooth = smooth.sum()
        elif reduction == "mean":
            safe = torch.where(labels == ignore, torch.zeros_like(labels), labels)
            count = keep.sum() if weight is None else (weight[safe] * keep).sum()
            smooth = smooth.sum() / count
        return (1 - eps) * nll + smooth * (eps / logp.shape[1])

    smoothed.__name__ = "CrossEntropyLoss"
    return smoothed


def _as_exported(loss: Any) -> Any:
    """The form of ``loss`` that exports with torch's formula."""
    import torch.nn as nn

    if isinstance(loss, nn.CrossEntropyLoss) and loss.label_smoothing > 0:
        return smoothed_cross_entropy(loss)
    return loss


def _scalar(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def example_labels(loss: Any, out: Any) -> Any:
    """Zeros the loss accepts as labels for the model's output ``out`` (module docstring)."""
    import torch

    with torch.no_grad():
        indices = torch.zeros((*out.shape[:1], *out.shape[2:]), dtype=torch.int64)
        like = torch.zeros_like(out)
        name = _name(loss)
        candidates = [indices] if name in INDEX_LOSSES else [like] if name in SHAPE_LOSSES \
            else [indices, like]
        failures = []
        for labels in candidates:
            try:
                value = loss(out, labels)
            except Exception as exc:  # noqa: BLE001 - the loss refuses these labels: next
                failures.append(f"{labels.dtype} {tuple(labels.shape)}: {exc}")
                continue
            if _scalar(value):
                return labels
            failures.append(f"{labels.dtype} {tuple(labels.shape)}: it returned "
                            f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}")
    raise GraphError(f"loss {name} does not give a float scalar for the model's output "
                     f"({out.dtype} {tuple(out.shape)}) and zero labels ({'; '.join(failures)}); "
                     "ngdist trains a loss(output, labels) that is a scalar (reduction='mean' "
                     "or 'sum')")


def _value_name(name: str) -> str:
    """A node value's name as the model's own export names it (``/ngdist_model/fc/Gemm_output_0``
    -> ``/fc/Gemm_output_0``, which evaluate() finds in the eval graph); the loss's values get
    ``/ngdist_loss/`` in front, apart from the model's."""
    inner = f"/{MODEL}/"
    if name.startswith(inner):
        return name[len(inner) - 1:]
    return f"/ngdist_loss{name}" if name.startswith("/") else name


def _strip_prefix(model: onnx.ModelProto) -> None:
    """The wrapper's state_dict names (``ngdist_model.fc.weight``) back to the model's, and its
    node values named as the model's export names them (``_value_name``)."""
    prefix = f"{MODEL}."
    renames = {t.name: t.name[len(prefix):] for t in model.graph.initializer
               if t.name.startswith(prefix)}
    renames.update((o, _value_name(o)) for n in model.graph.node for o in n.output
                   if _value_name(o) != o)
    rename_graph(model.graph, renames)


def export_with_loss(module: Any, loss: Any, args: tuple[Any, ...], input_names: list[str],
                     output_name: str, labels: str, opset: int, exporter: str,
                     appended: Sequence[str] = (), reset: Callable[[], None] | None = None
                     ) -> tuple[str, onnx.ModelProto, Any]:
    """(the exporter used, the training graph computing the loss, the example labels): the
    graph's inputs are ``input_names`` then ``labels``, its outputs ``LOSS_OUTPUT`` and the
    model's output named ``output_name``, as in the eval export (evaluate() reads it), then
    the ``appended`` buffers' new values (torch_exporters.export_training). ``reset`` puts
    back the buffers the forward that finds the output's shape moved, before the trace."""
    from ngdist.frontends.torch_exporters import export_training

    check_labels_name(labels, input_names, [LOSS_OUTPUT, output_name])
    out = _output(module, args)
    if reset is not None:
        reset()
    value = example_labels(loss, out)
    with _default_dtype(out.dtype):
        check_loss_export(loss, out, value, opset, exporter)
    wrapper = _wrapper(module, _as_exported(loss), len(args))
    with _default_dtype(out.dtype):
        used, train = export_training(wrapper, (*args, value), [*input_names, labels],
                                      [LOSS_OUTPUT, output_name], opset, exporter,
                                      [f"{MODEL}.{n}" for n in appended])
    _strip_prefix(train)
    _name_model_output(train, output_name)
    logger.info("exported the loss %s with the model (labels %s %s)", _name(loss),
                value.dtype, tuple(value.shape))
    return used, train, value


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """torch's default dtype is the output's while the loss is exported: the TorchScript
    exporter computes arithmetic on 0-d tensors (a loss's mean, sums of terms) in the default
    dtype, which would round a float64 loss to float32."""
    import torch

    if dtype not in (torch.float32, torch.float64):
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _output(module: Any, args: tuple[Any, ...]) -> Any:
    """The model's (first) output on ``args``, without gradients."""
    import torch

    with torch.no_grad():
        out = module(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


def _name_model_output(model: onnx.ModelProto, name: str) -> None:
    """The model's output value itself is named ``name``, as the loss reads it: the exporter
    makes the graph output an Identity of a value named after its node."""
    graph = model.graph
    node = next((n for n in graph.node if name in n.output), None)
    if node is None or node.op_type != "Identity":
        return
    source = node.input[0]
    if source in {i.name for i in graph.input} | {t.name for t in graph.initializer}:
        return
    graph.node.remove(node)
    rename_graph(graph, {source: name})


def _random_like(value: Any, output: Any) -> Any:
    """Labels of the example's shape and dtype, valid for either kind of loss."""
    import torch

    gen = torch.Generator().manual_seed(0)
    if value.dtype == torch.int64:
        classes = output.shape[1] if output.dim() > 1 else 2
        return torch.randint(0, classes, tuple(value.shape), generator=gen)
    return torch.rand(tuple(value.shape), generator=gen, dtype=value.dtype)


def check_loss_export(loss: Any, out: Any, labels: Any, opset: int, exporter: str) -> None:
    """The loss alone, exported and run by onnxruntime on the model's output and random labels,
    equals torch's value: an exporter that drops an argument (the dynamo exporter of torch
    2.13 drops ``label_smoothing``) is refused instead of training another loss."""
    import numpy as np
    import torch
    import torch.nn as nn

    from ngdist.frontends.torch_exporters import export_training
    from ngdist.runtime.sessions import make_session

    from ngdist.ir.model import IR_VERSION

    class Alone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fn = _as_exported(loss)

        def forward(self, output: Any, labels: Any) -> Any:
            return self.fn(output, labels)

    with torch.no_grad():
        out = out + torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                                dtype=out.dtype)
        target = _random_like(labels, out)
        expected = float(loss(out, target))
    _, graph = export_training(Alone(), (out, target), ["output", "labels"], ["loss"], opset,
                               exporter)
    graph.ir_version = min(graph.ir_version, IR_VERSION)
    session = make_session(graph, optimize=False)
    got = float(np.asarray(session.run(None, {"output": out.numpy(),
                                              "labels": target.numpy()})[0]))
    if not np.isclose(got, expected, rtol=1e-4, atol=1e-6):
        raise GraphError(f"the ONNX export of loss {_name(loss)} computes {got:.6g} where torch "
                         f"computes {expected:.6g} on the same output and labels (the exporter "
                         "dropped or changed an argument); write the loss with plain tensor ops "
                         "(log_softmax, gather, sum, mean)")


def is_loss_initializer(name: str) -> bool:
    """An initializer the exported loss holds (class weights): never a model parameter."""
    return name.startswith(f"{LOSS_FN}.")
