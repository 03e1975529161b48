"""Einsum: each operand's gradient is another Einsum, of the output gradient with the other
operands, producing that operand's subscripts.

A label of the operand that appears nowhere else (summed out by the operand alone) is not in
that product: the result is unsqueezed there and expanded back to the operand's shape. An
ellipsis that broadcast against another operand's is summed back to the operand's shape.
A label repeated within one operand (a diagonal, ``ii->i``) is refused.
"""
from __future__ import annotations

import re
import string

from ngdist.passes.autodiff.registry import register
from ngdist.passes.autodiff.rules._common import known_rank

ELLIPSIS = "..."


def _labels(term: str) -> list[str]:
    """``"...ij"`` -> ``["...", "i", "j"]``."""
    return re.findall(r"\.\.\.|[A-Za-z]", term)


def parse(equation: str, n_inputs: int) -> tuple[list[list[str]], list[str]]:
    """(labels of each input, labels of the output); an implicit output is the labels that
    occur once, sorted, after the ellipsis if any input has one."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = [_labels(t) for t in lhs.split(",")]
    if len(terms) != n_inputs:
        raise ValueError(f"Einsum equation {equation!r} names {len(terms)} operands, the node "
                         f"has {n_inputs}")
    if arrow:
        return terms, _labels(rhs)
    flat = [t for term in terms for t in term if t != ELLIPSIS]
    out = sorted(t for t in set(flat) if flat.count(t) == 1)
    return terms, ([ELLIPSIS] if any(ELLIPSIS in t for t in terms) else []) + out


def _width(labels: list[str], rank: int) -> int:
    """How many axes the ellipsis of an operand of rank ``rank`` covers."""
    return rank - len(labels) + 1


def _axes_of(labels: list[str], rank: int | None) -> list[tuple[str, int]]:
    """(label, axis) per axis of an operand; the ellipsis covers rank - (labels - 1) axes."""
    axes, pos = [], 0
    for t in labels:
        width = _width(labels, rank) if t == ELLIPSIS else 1
        axes += [(t, pos + k) for k in range(width)]
        pos += width
    return axes


def _spell_ellipsis(terms: list[list[str]], values, equation: str) -> list[list[str]]:
    """``terms`` with each ellipsis replaced by letters the equation does not use, aligned
    from the right (the values' ranks give each ellipsis its width)."""
    free = [c for c in string.ascii_letters if c not in equation]
    widths = [_width(t, known_rank(v, "Einsum operand")) if ELLIPSIS in t else 0
              for t, v in zip(terms, values)]
    names = free[:max(widths)]
    spelled = []
    for t, w in zip(terms, widths):
        fill = names[len(names) - w:] if w else []
        spelled.append([c for label in t for c in (fill if label == ELLIPSIS else [label])])
    return spelled


@register("Einsum")
def einsum(ctx, node, gys):
    equation = node.attributes["equation"].value
    terms, out = parse(equation, len(node.inputs))
    g = gys[0]
    grads = []
    for i, x in enumerate(node.inputs):
        if not ctx.needs(x):
            grads.append(None)
            continue
        mine = terms[i]
        letters = [t for t in mine if t != ELLIPSIS]
        if len(set(letters)) != len(letters):
            raise ValueError(f"Einsum operand {i} of {equation!r} repeats a label (a "
                             "diagonal), which is not differentiated; take the diagonal with "
                             "a mask and a sum instead")
        elsewhere = set(out).union(*(set(t) for j, t in enumerate(terms) if j != i))
        kept = [t for t in mine if t in elsewhere]
        others = [t for j, t in enumerate(terms) if j != i]
        operands = [node.inputs[j] for j in range(len(terms)) if j != i]
        ins = [out, *others]
        if ELLIPSIS not in kept and any(ELLIPSIS in t for t in ins):
            # onnxruntime refuses an ellipsis summed away: spell it out in unused letters
            ins = _spell_ellipsis(ins, [node.outputs[0], *operands], equation)
        eq = ",".join("".join(t) for t in ins) + "->" + "".join(kept)
        grad = ctx.op("Einsum", g, *operands, equation=eq)
        rank = known_rank(x, "Einsum operand") if ELLIPSIS in mine else len(mine)
        if ELLIPSIS in kept:  # summed back where the ellipsis broadcast
            if len(kept) != len(mine):
                raise ValueError(f"Einsum operand {i} of {equation!r} has an ellipsis and a "
                                 "label no other operand has, which is not differentiated")
            widths = [_width(labels, known_rank(v, "Einsum operand"))
                      for labels, v in zip([out, *others], [g if g.shape is not None
                                                            else node.outputs[0], *operands])
                      if ELLIPSIS in labels]
            grad = ctx.unbroadcast(grad, x, grad_rank=len(kept) - 1 + max(widths))
        lost = [axis for t, axis in _axes_of(mine, rank) if t not in kept]
        if lost:
            grad = ctx.op("Expand", ctx.op("Unsqueeze", grad, ctx.ints(lost)),
                          ctx.op("Shape", x))
        grads.append(grad)
    return grads
