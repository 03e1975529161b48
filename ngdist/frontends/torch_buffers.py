"""Buffers a torch module's training-mode forward changes, other than running statistics of
norm layers (whose ONNX BatchNormalization outputs carry their new values): a running maximum
assigned (``self.x_max = torch.maximum(self.x_max, m)``), an average updated in place
(``self.avg.mul_(0.9).add_(...)``).

The export's tracing forward and one real forward after it (torch.export traces fake tensors;
a module may update a buffer only outside an export) show them: a buffer rebound, written in
place (its ``_version``: a converged power iteration writes the same bytes) or changed since
the snapshot before. Such a module
is exported again with each of those buffers, as it stands after the forward, appended to the
outputs (a forward hook), and the training step writes those values back (``update_binding``,
as BatchNorm's statistics), so the trainer's buffers follow torch's step by step; several
ranks average them as they do BatchNorm's (passes/buffers.py). The traced update is one
straight-line formula: a module that branches on tensor values in Python (I-BERT's
``QuantAct`` initialises its range with another formula than the one it then averages with)
traces another graph from another state, so the module is traced a second time from the state
the first forward left, on other float inputs (a value read into Python, ``float(y.mean())``,
is a constant of the trace), and the two graphs must agree node for node. Refused, with the buffers
and modules named: graphs that differ, a changed buffer that is not a float tensor or whose
traced value is the old one, and a new value the forward reads again that depends on
parameters (torch updates without gradient; ONNX has no way to say so).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
from onnx import helper, numpy_helper

from ngdist.errors import GraphError

SHOWN = 6  # buffers or modules named in an error


def _norm_statistics(module: Any) -> set[str]:
    """state_dict names of the running statistics of norm layers (exported as ONNX
    BatchNormalization, which updates them itself)."""
    import torch

    norms = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)
    out: set[str] = set()
    for name, sub in module.named_modules():
        if isinstance(sub, norms) and sub.track_running_stats:
            prefix = f"{name}." if name else ""
            out.update(f"{prefix}{b}" for b in ("running_mean", "running_var",
                                                 "num_batches_tracked"))
    return out


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bytes (NaNs included, which ``torch.equal`` denies)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8),
                       b.detach().reshape(-1).view(torch.uint8))


def forward_updated(module: Any, saved: dict[str, tuple[Any, Any]], versions: dict[str, int]
                    ) -> list[str]:
    """The buffers (state_dict names) a forward changed since ``saved`` (torch_state.snapshot)
    and ``versions`` (each tensor's ``_version`` then) were taken: rebound, written in place
    (even with the same values) or holding other values; norm layers' statistics left out.
    Refused where one is not a float tensor."""
    import torch

    skip = {n for n, _ in module.named_parameters()} | _norm_statistics(module)
    current = module.state_dict(keep_vars=True)
    changed = []
    for name, (tensor, value) in saved.items():
        now = current.get(name)
        if name in skip or not isinstance(now, torch.Tensor):
            continue
        if now is not tensor or now._version != versions[name] or not same_bytes(now, value):
            changed.append(name)
    check_float(module, changed)
    return changed


def _listed(names: Sequence[str], most: int = SHOWN) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _module_name(module: Any, path: str) -> str:
    """"QuantAct 'a.b'" for a submodule, the class name for ``module`` itself, the path
    quoted where it names no submodule."""
    if not path:
        return type(module).__name__
    try:
        return f"{type(module.get_submodule(path)).__name__} '{path}'"
    except AttributeError:
        return f"'{path}'"


def _owners(module: Any, names: Sequence[str], most: int = 2) -> str:
    """The modules holding the buffers ``names`` (a scope for node names), ``most`` named."""
    paths = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
    shown = ", ".join(_module_name(module, p) for p in paths[:most])
    more = len(paths) - most
    return shown + (f" (and {more} more module{'s' if more > 1 else ''})" if more > 0 else "")


def check_float(module: Any, names: Sequence[str]) -> None:
    """Only float buffers are carried by the step (averaged over ranks as BatchNorm's are)."""
    import torch

    current = module.state_dict(keep_vars=True)
    bad = [n for n in names if not current[n].is_floating_point()]
    if bad:
        raise GraphError(f"the training-mode forward of {_owners(module, bad)} changes the "
                         f"non-float buffers {_listed(bad)} ({current[bad[0]].dtype}); ngdist "
                         "updates float buffers only. Keep the buffer as a float tensor, or "
                         "update it outside the module's forward")


@contextlib.contextmanager
def appended_outputs(module: Any, names: Sequence[str]) -> Iterator[None]:
    """While the block runs, ``module``'s forward returns its output followed by the buffers
    ``names`` as they stand after the forward."""
    if not names:
        yield
        return

    def hook(mod: Any, _inputs: Any, output: Any) -> Any:
        head = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        return (*head, *(mod.get_buffer(n) for n in names))

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def name_updates(model: onnx.ModelProto, names: Sequence[str],
                 saved: dict[str, tuple[Any, Any]], module: Any) -> dict[str, str]:
    """The graph's last ``len(names)`` outputs are the buffers' new values: each becomes an
    output ``<buffer>.new``, a ``CastLike`` of the value to the buffer (the TorchScript exporter
    computes on a 0-d tensor in the default dtype), which also keeps a buffer the forward
    assigns without reading an initializer (``saved``: torch_state.snapshot, its value);
    returns buffer -> that output."""
    held = {t.name for t in model.graph.initializer}
    model.graph.initializer.extend(numpy_helper.from_array(saved[n][1].cpu().numpy(), n)
                                   for n in names if n not in held)
    graph = model.graph
    tail = list(graph.output)[len(graph.output) - len(names):]
    updates: dict[str, str] = {}
    stale = []
    copies = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity"}
    for name, out in zip(names, tail):
        value = out.name
        while value in copies:
            value = copies[value]
        if value == name:  # the trace kept the old value: torch changed it another way
            stale.append(name)
        new = f"{name}.new"
        graph.node.append(helper.make_node("CastLike", [out.name, name], [new],
                                           name=f"ngdist/buffer_update/{name}"))
        out.name = new
        updates[name] = new
    if stale:
        raise GraphError(f"the training-mode forward of {_owners(module, stale)} changes the "
                         f"buffers {_listed(stale)}, but the traced graph does not (the update "
                         "is no traced tensor operation); compute it with torch operations on "
                         "tensors, or compile a model whose forward does not update buffers")
    return updates


def check_detached(model: onnx.ModelProto, updates: dict[str, str], module: Any) -> None:
    """A new buffer value the forward reads again must not depend on a parameter: torch
    updates buffers without gradient (``no_grad``, ``detach``), which ONNX cannot express, so
    the gradients would flow through the update."""
    from ngdist.passes.autodiff.registry import NON_DIFFERENTIABLE

    graph = model.graph
    buffer_of = {new: b for b, new in updates.items()}
    sources = {n.input[0]: buffer_of[n.output[0]] for n in graph.node
               if n.output and n.output[0] in buffer_of}
    reached = {n for n, _ in module.named_parameters()}
    readers: dict[str, int] = {}
    for node in graph.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
        if node.op_type not in NON_DIFFERENTIABLE and reached.intersection(node.input):
            reached.update(node.output)
    bad = [b for v, b in sources.items() if v in reached and readers.get(v, 0) > 1]
    if bad:
        raise GraphError(
            f"the training-mode forward of {_owners(module, bad)} reads the buffers "
            f"{_listed(bad)} after updating them from values that depend on parameters: "
            "torch updates them without gradient (no_grad, detach), which the exported graph "
            "cannot express, so its gradients would differ. Read the buffers before updating "
            "them, or compile a model whose forward does not update buffers")


def _scope(node_name: str) -> str:
    """'/ibert/embeddings/act/Add_1' -> 'ibert.embeddings.act.Add_1', the exporter's module
    scope with a last part for ``_owners`` to drop."""
    return ".".join(p for p in node_name.split("/") if p and p != "ngdist_model")


def other_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The example inputs with other float values (shapes and integer inputs kept): a trace
    that reads a tensor's value into Python (float(), a branch) then differs."""
    return tuple(a * 0.5 + 0.25 if a.is_floating_point() else a for a in args)


def _signature(node: onnx.NodeProto) -> bytes:
    """The node without its doc string and metadata (the dynamo exporter's stack traces name
    a generated file per export)."""
    bare = onnx.NodeProto()
    bare.CopyFrom(node)
    bare.ClearField("doc_string")
    bare.ClearField("metadata_props")
    return bare.SerializeToString(deterministic=True)


def check_same_trace(first: onnx.ModelProto, second: onnx.ModelProto, names: Sequence[str],
                     module: Any) -> None:
    """Two training graphs traced from different buffer values must agree node for node."""
    a = [_signature(n) for n in first.graph.node]
    b = [_signature(n) for n in second.graph.node]
    if a == b:
        return
    common = set(a) & set(b)
    differ = {_scope(n.name) for n in (*first.graph.node, *second.graph.node)
              if _signature(n) not in common}
    owners = {b: b.rpartition(".")[0] for b in names}
    held = [b for b, o in owners.items() if any(not o or d.startswith(f"{o}.") for d in differ)]
    raise GraphError(
        f"{_owners(module, held or sorted(differ), 1)} reads tensor values into Python (a "
        "branch, float(), .item()) where its training-mode forward updates buffers "
        f"({_listed(list(names), 1)}): traced again from the state one forward leaves, on "
        "other inputs, it gives another graph, so one traced graph cannot update them as torch "
        "does. Write the update with tensor operations (torch.where for a branch), or compile "
        "a model whose forward does not update buffers")
