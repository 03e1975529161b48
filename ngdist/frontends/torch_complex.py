"""Complex tensors in the TorchScript export (lent with the other symbolics by
``frontends/torch_symbolics.py``): ONNX has no complex type that onnxruntime computes with, so
a complex tensor is written as a real one with a trailing axis of 2, (real, imaginary):
torch's own ``view_as_real`` layout. Rotary embeddings written with complex numbers (Hugging
Face DeepSeek-V2 and Llama 4: ``polar``, ``view_as_complex``, a complex product,
``view_as_real``) export to real ops whose gradients ngdist has:

* ``aten::polar(abs, angle)``: ``abs * cos(angle)`` and ``abs * sin(angle)`` stacked last;
* ``aten::view_as_complex`` / ``aten::view_as_real``: the same tensor (the layouts agree);
* ``aten::to`` of a complex tensor: the pairs (a device move), or both parts cast (another
  complex type);
* ``aten::mul`` with a complex operand: ``(ar br - ai bi, ar bi + ai br)``, a real operand
  broadcast over both parts; products of real tensors keep torch's symbolic.

Every other operator torch applies to a complex value is refused at export with the
operator's name (:func:`complex_checked`), rather than computed on the pairs as if they were
real numbers: an op that counts axes from the end, or adds a real tensor, would be wrong.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ngdist.errors import GraphError
from ngdist.frontends.torch_math import const

# operators whose symbolics here, or whose torch symbolics, are right on the pair layout:
# these, and indexing with dims counted from the front (checked by check_complex)
_CARRY = {"aten::polar", "aten::view_as_complex", "aten::view_as_real", "aten::mul",
          "aten::to", "aten::detach", "aten::contiguous", "aten::clone"}
_FRONT_DIM = {"aten::unsqueeze": 1, "aten::slice": 1, "aten::select": 1}


def _is_complex(value: Any) -> bool:
    return _scalar_type(value).startswith("Complex")


def _scalar_type(value: Any) -> str:
    import torch

    kind = value.type()
    return str(kind.scalarType() or "") if isinstance(kind, torch._C.TensorType) else ""


def _part(g: Any, z: Any, i: int) -> Any:
    return g.op("Gather", z, const(g, i), axis_i=-1)


def _pair(g: Any, re: Any, im: Any) -> Any:
    last = const(g, [-1])
    return g.op("Concat", g.op("Unsqueeze", re, last), g.op("Unsqueeze", im, last), axis_i=-1)


def polar(g: Any, magnitude: Any, angle: Any) -> Any:
    return _pair(g, g.op("Mul", magnitude, g.op("Cos", angle)),
                 g.op("Mul", magnitude, g.op("Sin", angle)))


def view_as_pairs(g: Any, x: Any) -> Any:
    return x


# the traced scalar types of the inputs of the node being converted (the converted values
# of complex ones are real pairs: their types no longer say so); set by complex_checked
_TRACED: list[str] = []
_TRACED_OUT: list[str] = []
_PARTS = {"ComplexFloat": 1, "ComplexDouble": 11}  # the ONNX type of a complex's parts


def _mul(builtin: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g: Any, a: Any, b: Any) -> Any:
        ta, tb = (_TRACED + ["", ""])[:2]
        ca, cb = ta.startswith("Complex"), tb.startswith("Complex")
        if not (ca or cb):
            return builtin(g, a, b)
        if ca and cb:
            ar, ai, br, bi = _part(g, a, 0), _part(g, a, 1), _part(g, b, 0), _part(g, b, 1)
            return _pair(g, g.op("Sub", g.op("Mul", ar, br), g.op("Mul", ai, bi)),
                         g.op("Add", g.op("Mul", ar, bi), g.op("Mul", ai, br)))
        (z, kind), r = ((a, ta), b) if ca else ((b, tb), a)  # r real: in z's parts' type,
        r = g.op("Cast", r, to_i=_PARTS.get(kind, 1))  # broadcast over (real, imaginary)
        return g.op("Mul", z, g.op("Unsqueeze", r, const(g, [-1])))

    return symbolic


def _to(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.to`` of a complex tensor: a device move is the pairs themselves, another
    complex type a Cast of both parts; a real type (which drops the imaginary part) refused."""
    def symbolic(g: Any, x: Any, *args: Any) -> Any:
        if not _TRACED or not _TRACED[0].startswith("Complex"):
            return builtin(g, x, *args)
        out = (_TRACED_OUT + [""])[0]
        if out == _TRACED[0]:
            return x
        if out in _PARTS:
            return g.op("Cast", x, to_i=_PARTS[out])
        raise GraphError(f"cannot export aten::to from {_TRACED[0]} to {out or 'a real type'}: "
                         "ngdist writes complex tensors as (real, imaginary) pairs; take "
                         "torch.view_as_real(z)[..., 0] for the real part")

    return symbolic


def _check(node: Any) -> None:
    """Refuses ``node`` where it applies an operator other than those this module writes on
    the pair layout to a complex value (or indexes one along an axis counted from the end)."""
    kind = node.kind()
    inputs = list(node.inputs())
    if not any(_is_complex(v) for v in inputs) or kind in _CARRY or kind.startswith("prim::"):
        return
    if kind in _FRONT_DIM:
        dim = inputs[_FRONT_DIM[kind]].toIValue()  # an int, or a traced 0-d tensor
        if dim is not None and not isinstance(dim, int) and dim.numel() == 1:
            dim = int(dim)
        if isinstance(dim, int) and dim >= 0:
            return
    raise GraphError(f"cannot export {kind} of a complex tensor: ngdist writes complex tensors "
                     "as (real, imaginary) pairs and supports polar, view_as_complex, "
                     "view_as_real, products and indexing along leading axes; compute with "
                     "real tensors (torch.view_as_real) instead")


@contextlib.contextmanager
def complex_checked() -> Iterator[None]:
    """Every node the TorchScript exporter converts in the block passes :func:`_check` first
    (torch looks its node converter up at each node, so it is wrapped for the block)."""
    from torch.onnx._internal.torchscript_exporter import utils

    builtin = utils._run_symbolic_function

    def run(graph: Any, block: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        _check(node)
        _TRACED[:] = [_scalar_type(v) for v in node.inputs()]
        _TRACED_OUT[:] = [_scalar_type(v) for v in node.outputs()]
        try:
            return builtin(graph, block, node, *args, **kwargs)
        finally:
            _TRACED.clear()
            _TRACED_OUT.clear()

    utils._run_symbolic_function = run
    try:
        yield
    finally:
        utils._run_symbolic_function = builtin


SYMBOLICS: dict[str, Callable[..., Any]] = {
    "aten::polar": polar,
    "aten::view_as_complex": view_as_pairs,
    "aten::view_as_real": view_as_pairs,
}
WRAPS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {"aten::mul": _mul,
                                                                       "aten::to": _to}
