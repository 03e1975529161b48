"""The optimizer of a training model in words (``ngdist inspect``): one line per parameter
group, i.e. per optimizer node, with its formula, learning rate, hyper-parameters and
parameters."""
from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.hyper import lr_groups
from ngdist.passes.optimizers.common import (EXACT_ATTR, FORMULA_ATTR, OPTIMIZER_OPS, decimal,
                                             exact_entries, exact_values, state_kinds)

_SHOWN = 6  # parameter names listed per group


def _value(a: onnx.AttributeProto) -> object:
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    return decimal(v) if isinstance(v, float) else v


def optimizer_lines(model: onnx.ModelProto) -> list[str]:
    """``optimizer: N group(s)`` and a line per group; nothing for a forward-only model."""
    if not model.training_info:
        return []
    alg = model.training_info[0].algorithm
    inits = {t.name: t for t in alg.initializer}
    nodes = [n for n in alg.node if n.domain == PREVIEW_TRAINING and n.op_type in OPTIMIZER_OPS]
    out = [f"optimizer: {len(nodes)} group(s)"]
    for n in nodes:
        attrs = {a.name: _value(a) for a in n.attribute}
        attrs[EXACT_ATTR] = exact_entries({p.key: p.value for p in n.metadata_props})
        attrs.update(exact_values(f"optimizer node {n.name!r}", attrs))
        attrs.pop(EXACT_ATTR, None)
        kinds = state_kinds(n.op_type, attrs)
        formula = attrs.pop(FORMULA_ATTR, None) or f"onnx {n.op_type}"
        lr_input = n.input[0]
        index = next(iter(lr_groups([lr_input])), "?")
        lr = float(numpy_helper.to_array(inits[lr_input])) if lr_input in inits else None
        params = list(n.input[2:])[:(len(n.input) - 2) // (2 + len(kinds))]
        shown = ", ".join(params[:_SHOWN]) + (f", ... ({len(params)})" if len(params) > _SHOWN
                                               else "")
        hyper = " ".join(f"{k.removeprefix('ngdist_')}={v}" for k, v in sorted(attrs.items()))
        out.append(f"  group {index}  {n.name}  {formula}  lr={lr_input}"
                   f"{'' if lr is None else f' ({decimal(lr)})'}  {hyper}")
        out.append(f"      params: {shown}")
    return out
