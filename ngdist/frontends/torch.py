"""PyTorch frontend: ``torch.nn.Module`` -> standard ONNX training model -> ngdist trainer.

Export path (measured with torch 2.13): the dynamo exporter drops a training-mode
BatchNormalization altogether, so the module is exported twice with the TorchScript exporter
(``dynamo=False``, ``do_constant_folding=False``, opset 18, a symbolic batch axis):

* in ``TrainingMode.TRAINING`` for the training step: ``BatchNormalization(training_mode=1)``
  (batch statistics; its running-mean/-variance outputs become the new buffer values) and
  ``Dropout`` with ``training_mode=True`` (a fresh mask every step);
* in ``TrainingMode.EVAL`` for ``model.graph``, the deployable inference graph (running
  statistics, no dropout), exactly what ``module.eval()`` computes.

A module the TorchScript exporter cannot export (an operator without a symbolic) is exported
by the dynamo exporter instead, unless it keeps running statistics (torch_exporters.py).

Both exports name their initializers after ``module.state_dict()``, which is how trained values
are written back (``trainer.to_torch(module)``). Exporting runs the module's forward, which
updates BatchNorm buffers in training mode: the frontend copies every parameter and buffer
back in place afterwards (the same tensor objects; the state dict's ``_metadata`` untouched).
Other buffers its forward updates are updated by the step too, or refused (torch_buffers.py).

Semantic adjustments: ONNX's BatchNormalization updates the running variance with the
*biased* batch variance, PyTorch with the unbiased one; the frontend rescales the
running-variance output by n / (n - 1) so that running statistics match PyTorch's.
``BatchNorm(momentum=None)`` (cumulative average) has no ONNX counterpart and is refused.
``nn.Embedding(padding_idx=p)`` keeps row p out of the lookup's gradient; ``max_norm``,
``scale_grad_by_freq`` and sparse gradients torch's optimizer refuses are refused
(``frontends/torch_embedding.py``).

A torch loss module or function given as ``loss=`` is exported with the model, so any loss
torch can export trains with torch's formula (``frontends/torch_loss.py``).

Optimizers follow PyTorch's formulas exactly (``docs/ARCHITECTURE.md``, "Optimizer formulas"):
``torch.optim.SGD`` maps onto ONNX Momentum (beta = 1 - dampening); ``Adam`` and ``AdamW``
become ONNX Adam nodes marked with PyTorch's formula (ONNX's own adds epsilon before the bias
correction). ``foreach``, ``fused``, ``capturable`` and ``differentiable`` only choose torch's
implementation and are ignored (``frontends/torch_optim.py``).

Custom autograd Functions whose backward differs from autograd through their forward are
refused by name (``frontends/torch_custom_grad.py``).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from ngdist import optim
from ngdist.errors import ArgumentError, ArgumentTypeError, GraphError
from ngdist.frontends.cleanup import (batch_feeds, fold_static_shapes, squeezing_splits,
                                      unbiased_running_var)
from ngdist.frontends.torch_exporters import (export_graph, export_training, rename_aliases,
                                               tied_aliases)
from ngdist.frontends.torch_buffers import (check_detached, check_same_trace, forward_updated,
                                            name_updates, other_inputs)
from ngdist.frontends.torch_embedding import check_embeddings, mark_padding_rows
from ngdist.frontends.torch_stop_gradient import gradient_free
from ngdist.frontends import torch_loss
from ngdist.frontends.torch_state import (check_batchnorm, mark_unique, rename_initializers,
                                          restore, snapshot)
from ngdist.frontends.torch_custom_grad import check_module
from ngdist.frontends.torch_trace_check import traced_from_data
from ngdist.frontends.torch_optim import (_optimizer_params, lr_source, restrict_groups,
                                          translate_optimizer, write_optimizer_state)
from ngdist.ir.copies import with_tensor_data, without_tensor_data
from ngdist.ir.writeback import WriteBack

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

OPSET = 18
_UNSET: Any = object()


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the PyTorch frontend needs torch and onnxscript: "
                          "pip install 'ngdist[torch]'") from exc
    return torch


def is_module(obj: Any) -> bool:
    """True for a ``torch.nn.Module`` instance, without importing torch."""
    return any(c.__name__ == "Module" and c.__module__.startswith("torch.nn")
               for c in type(obj).__mro__)


@dataclass
class TorchExport:
    """Both exports of one module and how ONNX names map to the module's state_dict."""

    train: onnx.ModelProto
    eval: onnx.ModelProto
    input_names: list[str]
    output_names: list[str]
    params: dict[str, str] = field(default_factory=dict)   # onnx name -> parameter name
    buffers: dict[str, str] = field(default_factory=dict)  # onnx name -> buffer name
    # buffers the training-mode forward updates (norm statistics aside) -> their new values
    updates: dict[str, str] = field(default_factory=dict)
    exporter: str = "torchscript"  # the torch.onnx exporter that made both graphs
    # the example inputs (labels included) cycled to cleanup.BATCH_SIZES: what the graph's
    # shapes are probed with (made-up inputs, zeros for indices and masks, can drive a model
    # into empty tensors onnxruntime crashes on); emptied once the training model is built
    probes: list[dict[str, np.ndarray]] = field(default_factory=list)


# --------------------------------------------------------------------------- export

def _as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    torch = _torch()
    items = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    out = []
    for x in items:
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x)
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"example_inputs must be tensors or numpy arrays; got "
                            f"{type(x).__name__}")
        out.append(x)
    if not out:
        raise ArgumentError("example_inputs is empty: pass one example batch for the module's "
                         "forward (e.g. torch.zeros(2, 1, 8, 8))")
    return tuple(out)


def _default_input_names(module: Any, n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    if len(names) < n or len(set(names)) < n:
        names = [f"input{i}" for i in range(n)]
    return names


def _check_not_hf_model(module: Any) -> None:
    """A Hugging Face model returns a ModelOutput with a key/value cache, which the
    TorchScript exporter cannot trace: refused with the wrapper to write instead."""
    if any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
           for c in type(module).__mro__):
        raise GraphError(
            f"{type(module).__name__} is a Hugging Face model: its forward returns a "
            "ModelOutput (with a key/value cache), which torch.onnx.export cannot trace. "
            "Compile a module whose forward returns the loss, e.g. forward(self, input_ids, "
            "labels): return self.model(input_ids=input_ids, labels=labels).loss, with "
            "loss=None (ngdist.zoo_transformers.build wraps its models so)")


def export(module: Any, example_inputs: Any, *, input_names: Sequence[str] | None = None,
           output_names: Sequence[str] | None = None, opset: int = OPSET,
           exporter: str = "torchscript", loss: Any = None, labels: str = "y") -> TorchExport:
    """Exports ``module`` in training and eval mode; its parameters and buffers are untouched.

    ``exporter``: the torch.onnx exporter tried first (``torchscript`` or ``dynamo``); where it
    fails the other one is tried (frontends/torch_exporters.py). ``loss``: a torch loss
    exported with the training graph, whose one output is then the loss of the model's output
    and the input ``labels`` (frontends/torch_loss.py).
    """
    if not is_module(module):
        raise ArgumentTypeError(f"expected a torch.nn.Module; got {type(module).__name__}")
    if opset < 15:
        raise ArgumentError("opset must be >= 15 (training-mode BatchNormalization)")
    check_batchnorm(module)
    _check_not_hf_model(module)
    args = _as_tuple(example_inputs)
    in_names = list(input_names) if input_names else _default_input_names(module, len(args))
    if len(in_names) != len(args):
        raise ArgumentError(f"{len(in_names)} input names for {len(args)} example inputs")
    out_names = list(output_names) if output_names else ["output"]
    saved = snapshot(module)
    check_module(module, args)  # custom autograd Functions
    restore(module, saved)
    used, train, updates, example, ev = _export_both(module, args, in_names, out_names, opset,
                                                     exporter, loss, labels, saved)
    feed_values = dict(zip(in_names, args), **({} if loss is None else {labels: example}))
    state = {k: v.cpu().numpy() for k, (_, v) in saved.items() if v.is_floating_point()}
    params = {n for n, _ in module.named_parameters()}
    aliases = tied_aliases(module)
    rename_initializers(train, state)
    for model in (train, ev):
        rename_aliases(model, aliases)
    del model
    # the values before tracing touched them
    train = with_tensor_data(train, state)
    ev = with_tensor_data(ev, state)
    if traced_from_data(module, args, in_names, train, ev, retry=exporter == "torchscript"):
        return export(module, example_inputs, input_names=in_names, output_names=out_names,
                      opset=opset, exporter="dynamo", loss=loss, labels=labels)
    feeds = batch_feeds({n: a.detach().cpu().numpy() for n, a in feed_values.items()})
    result = TorchExport(train, ev, in_names, out_names, exporter=used, probes=feeds,
                         updates=updates)
    for t in train.graph.initializer:
        if t.name in state:
            (result.params if t.name in params else result.buffers)[t.name] = t.name
    for model in (train, ev):  # (before folding: its probes then run as the step will)
        squeezing_splits(model)
    folded = [fold_static_shapes(model, feeds) for model in (train, ev)]
    logger.info("exported %s with the %s exporter: %d nodes (train), %d (eval), %d params, "
                "%d buffers, %s shape values folded", type(module).__name__, used,
                len(train.graph.node), len(ev.graph.node), len(result.params),
                len(result.buffers), folded)
    return result


def _export_both(module: Any, args: tuple[Any, ...], in_names: list[str], out_names: list[str],
                 opset: int, exporter: str, loss: Any, labels: str, saved: dict[str, Any]
                 ) -> tuple[str, onnx.ModelProto, dict[str, str], Any, onnx.ModelProto]:
    """``_trace_updating``'s four, then the eval graph; ``module`` left as ``saved`` has it."""

    def trace(appended: Sequence[str], inputs: tuple[Any, ...] = args) -> tuple[Any, ...]:
        if loss is None:
            return (*export_training(module, inputs, in_names, out_names, opset, exporter,
                                     appended), None)
        before = snapshot(module, buffers_only=True)  # the example labels' forward moves them
        return torch_loss.export_with_loss(module, loss, inputs, in_names, out_names[0], labels,
                                           opset, exporter, appended,
                                           reset=lambda: restore(module, before))

    was_training = module.training
    try:  # grad mode stays on: under no_grad, eval-mode transformer layers take a fused
        # fast path (aten::_transformer_encoder_layer_fwd) that has no ONNX export
        if loss is not None:
            torch_loss.check_labels_name(labels, in_names, out_names)
        used, train, updates, example = _trace_updating(trace, module, args, saved)
        restore(module, saved)
        # eval export: the exporter merges initializers of equal value (BatchNorm's weight and
        # running_var are both ones), so every tensor gets unique values while it runs
        marked = mark_unique(module)
        ev = export_graph(used, module, args, False, in_names, out_names, opset)
        rename_initializers(ev, marked)  # (while the module holds the marked values)
        del marked
    finally:
        restore(module, saved)  # tracing in training mode moved BN statistics
        module.train(was_training)
    return used, train, updates, example, ev


def _trace_updating(trace: Any, module: Any, args: tuple[Any, ...], saved: dict[str, Any]
                    ) -> tuple[str, onnx.ModelProto, dict[str, str], Any]:
    """(exporter, training graph, buffer -> its new value, example labels): a module whose
    forward changes buffers is traced twice more with their new values as outputs, from the
    state that forward left on other inputs and from ``saved`` (kept; torch_buffers.py)."""
    versions = {k: t._version for k, (t, _) in saved.items()}  # in-place writes count them
    used, train, example = trace(())
    with _torch().no_grad():  # torch.export's fake tensors never move buffers, and a forward
        module(*args)  # may update some only outside an export (is_in_onnx_export)
    updated = forward_updated(module, saved, versions)
    if not updated:
        return used, train, {}, example
    _, again, _ = trace(updated, other_inputs(args))
    restore(module, saved)
    used, train, example = trace(updated)
    check_same_trace(train, again, updated, module)
    logger.info("%s updates buffers in its forward: %s", type(module).__name__, updated)
    updates = name_updates(train, updated, saved, module)
    check_detached(train, updates, module)
    return used, train, updates, example


# --------------------------------------------------------------------------- translation

def translate_loss(loss: Any) -> str | None:
    """torch loss / ngdist loss name / None -> ngdist loss name; None also for a loss that is
    exported with the model (frontends/torch_loss.py)."""
    return torch_loss.builtin_name(loss)


# --------------------------------------------------------------------------- training model

def training_model(module: Any, example_inputs: Any, *, loss: Any = "softmax_cross_entropy",
                   labels: str = "y", optimizer: Any = _UNSET,
                   input_names: Sequence[str] | None = None,
                   output_names: Sequence[str] | None = None,
                   frozen: Sequence[str] | None = None, exporter: str = "torchscript"
                   ) -> tuple[onnx.ModelProto, TorchExport]:
    """The standard ONNX training model of ``module``: training-mode algorithm, eval graph;
    and the record of the export, its graphs without tensor data (the model holds them).
    ``exporter``: the torch.onnx exporter tried first (see ``export``)."""
    from ngdist.frontends.onnx import build_training_model, use_inference_graph

    if optimizer is _UNSET or optimizer is None:
        raise optim.missing_optimizer(
            f"torch module {type(module).__name__}",
            ", a torch optimizer such as torch.optim.SGD(model.parameters(), lr=0.01),")
    if isinstance(optimizer, (str, *optim.OPTIMIZERS)):
        opt = optim.from_spec(optimizer)
        trained = [n for n, p in module.named_parameters() if p.requires_grad]
    else:
        opt = translate_optimizer(optimizer, module)
        trained = _optimizer_params(module, optimizer)
    check_embeddings(module, opt if isinstance(optimizer, (str, *optim.OPTIMIZERS))
                     else optimizer)
    exp = _export_with_loss(module, example_inputs, loss, labels, input_names, output_names,
                            exporter)
    mark_padding_rows(module, exp.train)
    frozen_set = set(frozen or []) | gradient_free(exp.train)  # torch's .grad stays None
    trained = [n for n in trained if n in exp.params and n not in frozen_set]
    if not isinstance(optimizer, optim.OPTIMIZERS):  # torch's groups: what the graph trains
        opt = restrict_groups(opt, trained)
    if not trained:
        raise GraphError("no trainable parameter of the module appears in the exported graph")
    with_loss = exp.train.graph.output[0].name == torch_loss.LOSS_OUTPUT
    model = build_training_model(exp.train, loss=None if with_loss else translate_loss(loss),
                                 labels=labels, optimizer=opt, params=trained,
                                 output=torch_loss.LOSS_OUTPUT if with_loss
                                 else exp.output_names[0], buffers=exp.updates,
                                 probes=exp.probes)
    unbiased_running_var(model)
    # the model holds the values: the export's record (a write-back lives as long as the
    # trainer) keeps its graphs without data, once the eval graph's own tensors are moved
    held = {t.name for t in model.graph.initializer}
    ev = without_tensor_data(exp.eval, held.__contains__)
    exp = dataclasses.replace(exp, train=without_tensor_data(exp.train, lambda _: True),
                              eval=without_tensor_data(exp.eval, lambda _: True), probes=[])
    return use_inference_graph(model, ev), exp


def _export_with_loss(module: Any, example_inputs: Any, loss: Any, labels: str,
                      input_names: Sequence[str] | None, output_names: Sequence[str] | None,
                      exporter: str) -> TorchExport:
    """``export``, with the loss in the training graph where it has no built-in form or the
    output is already a (log-)softmax that torch's cross-entropy normalises again."""
    from ngdist.frontends.onnx import softmax_output

    def run(with_loss: bool) -> TorchExport:
        return export(module, example_inputs, input_names=input_names,
                      output_names=output_names, exporter=exporter,
                      loss=loss if with_loss else None, labels=labels)

    if torch_loss.exported(loss):
        return run(True)
    exp = run(False)
    if translate_loss(loss) == "softmax_cross_entropy" and not isinstance(loss, str) and \
            softmax_output(exp.train.graph, exp.output_names[0]) is not None:
        return run(True)
    return exp


# --------------------------------------------------------------------------- write-back

def to_torch(values: Mapping[str, np.ndarray], steps_done: int, module: Any, exp: TorchExport,
             optimizer: Any = None, batches_tracked: dict[str, int] | None = None) -> Any:
    """Copies trained ``values`` (a trainer's state_dict) into ``module``'s parameters and
    buffers, and into the torch ``optimizer``'s state when given."""
    torch = _torch()
    target = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for onnx_name, name in {**exp.params, **exp.buffers}.items():
            if onnx_name in values and name in target:
                t = target[name]
                t.copy_(torch.from_numpy(np.array(values[onnx_name])).to(t.dtype))
        for name, base in (batches_tracked or {}).items():
            target[name].fill_(base + steps_done)
    if optimizer is not None:
        _write_optimizer_state(values, steps_done, module, exp, optimizer)
    return module


def _write_optimizer_state(values: Mapping[str, np.ndarray], steps_done: int, module: Any,
                           exp: TorchExport, opt: Any) -> None:
    named = dict(module.named_parameters())
    write_optimizer_state(values, int(values.get("ngdist.step", steps_done)),
                          {o: named[n] for o, n in exp.params.items() if n in named}, opt)


def build(module: Any, example_inputs: Any, *, loss: Any = "softmax_cross_entropy",
          labels: str = "y", optimizer: Any = _UNSET, input_names: Sequence[str] | None = None,
          output_names: Sequence[str] | None = None, frozen: Sequence[str] | None = None,
          exporter: str = "torchscript") -> tuple[onnx.ModelProto, WriteBack]:
    """Export ``module``: its training model and the write-back ``trainer.to_torch`` calls.

    ``to_torch(module=None, optimizer=...)`` writes the trained parameters and BatchNorm
    buffers (and, given a torch optimizer, its state; by default the one compiled with) back.
    """
    model, exp = training_model(module, example_inputs, loss=loss, labels=labels,
                                optimizer=optimizer, input_names=input_names,
                                output_names=output_names, frozen=frozen, exporter=exporter)
    tracked = {k: int(v) for k, v in module.state_dict().items()
               if k.endswith("num_batches_tracked")}
    native = optimizer is _UNSET or optimizer is None or \
        isinstance(optimizer, (str, *optim.OPTIMIZERS))
    default_opt = None if native else optimizer

    def write(values: Mapping[str, np.ndarray], steps_done: int, /, target: Any = None,
              optimizer: Any = default_opt) -> Any:
        return to_torch(values, steps_done, module if target is None else target, exp,
                        optimizer, tracked)

    hypers = None if native else lr_source(optimizer, translate_optimizer(optimizer, module))
    return model, WriteBack("torch", write, exp, hypers)
