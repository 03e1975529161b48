"""The optimizer part of a training model: one optimizer node per parameter group.

Group i (``ngdist.optim`` ``param_groups``) updates its parameters with its own node and its
own learning rate (``ngdist.ir.hyper.lr_name(i)``, role ``hyper``, float64 for a float64
group); its other hyper-parameters are the node's attributes, but for a scheduled momentum
(``scheduled_momentum``: ``momentum_name(i)``, the node's last input; NAdam's also reads its
running ``mu_product_name(i)``, a state). Every node reads the one step counter.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ngdist import optim
from ngdist.ir.hyper import lr_name, momentum_name
from ngdist.passes.optimizers import MU_PRODUCT, SCHEDULED_ATTR
from ngdist.passes.optimizers.common import make_optimizer_node


@dataclass
class OptimizerNodes:
    """What the optimizer adds to the step graph."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)  # lr values, states
    outputs: list[str] = field(default_factory=list)  # new parameters and states
    binding: dict[str, str] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)


def hyper_dtype(params: Iterable[onnx.TensorProto]) -> type:
    """The type of a group's hyper-parameter values: float64 when a parameter of the group is
    float64 (torch keeps them Python floats, so a float64 model's update runs on every digit
    of its learning rate), else float32 (the update casts them to its parameters' type)."""
    double = onnx.TensorProto.DOUBLE
    return np.float64 if any(t.data_type == double for t in params) else np.float32


def mu_product_name(group: int) -> str:
    """NAdam's running mu_product of parameter group ``group`` (a scheduled beta1)."""
    return "ngdist.mu_product" if group == 0 else f"ngdist.mu_product.{group}"


def optimizer_nodes(opt: optim.Optimizer, params: Sequence[str],
                    inits: Mapping[str, onnx.TensorProto], step: str) -> OptimizerNodes:
    """The nodes updating ``params`` (initializers in ``inits``) with ``opt`` at step ``step``."""
    out = OptimizerNodes()
    t_name = None
    for index, group_opt, names in opt.param_groups(params):
        lr, dtype = lr_name(index), hyper_dtype(inits[p] for p in names)
        out.initializers.append(numpy_helper.from_array(np.array(group_opt.lr, dtype), lr))
        out.roles[lr] = "hyper"
        t = step
        if group_opt.step_offset:
            if t_name is None:
                t_name = f"{step}.t"
                out.nodes.append(helper.make_node(
                    "Constant", [], ["ngdist/one"], name="ngdist/one",
                    value=numpy_helper.from_array(np.array(1, np.int64))))
                out.nodes.append(helper.make_node("Add", [step, "ngdist/one"], [t_name],
                                                  name="ngdist/step_t"))
            t = t_name
        scheduled = [momentum_name(index)] if group_opt.scheduled() else []
        for name, value in zip(scheduled, group_opt.scheduled().values()):
            out.initializers.append(numpy_helper.from_array(np.array(value, dtype), name))
            out.roles[name] = "hyper"
        if MU_PRODUCT in group_opt.attributes().get(SCHEDULED_ATTR, ()):
            scheduled.append(_mu_product(out, index, group_opt, t, dtype))
        state_groups = []
        for suffix in group_opt.state_suffixes:
            group = []
            for p in names:
                arr = numpy_helper.to_array(inits[p])
                out.initializers.append(numpy_helper.from_array(
                    np.full_like(arr, group_opt.state_init(suffix)), f"{p}.{suffix}"))
                group.append(f"{p}.{suffix}")
            state_groups.append(group)
        flat = [s for group in state_groups for s in group]
        new = [f"{p}.new" for p in names] + [f"{s}.new" for s in flat]
        suffix = "" if index == 0 else f".{index}"
        out.nodes.append(make_optimizer_node(
            group_opt.op_type, [lr, t, *names, *[f"{p}.grad" for p in names], *flat,
                                *scheduled], new, group_opt.attributes(),
            name=f"ngdist/{group_opt.op_type.lower()}{suffix}"))
        out.outputs += new
        out.binding.update({p: f"{p}.new" for p in [*names, *flat]})
        out.roles.update({p: "param" for p in names})
        out.roles.update({s: "state" for s in flat})
    return out


def _mu_product(out: OptimizerNodes, index: int, opt: optim.NAdam, t: str, dtype: type
                ) -> str:
    """torch's NAdam ``mu_product *= mu`` for a scheduled beta1: a state of the group, 1 at
    first, times this step's mu = beta1 (1 - 0.5 * 0.96^(t * momentum_decay)) (computed in
    float64, as torch's Python floats, then in the state's type). Returns the new product's
    name, which the optimizer node reads."""
    name, prefix = mu_product_name(index), f"ngdist/mu_product.{index}"
    double = onnx.TensorProto.DOUBLE

    def node(op: str, inputs: list[str], tag: str, **attrs: object) -> str:
        out.nodes.append(helper.make_node(op, inputs, [f"{prefix}/{tag}"], name=f"{prefix}/{tag}",
                                          **attrs))
        return f"{prefix}/{tag}"

    def const(value: float, tag: str) -> str:
        return node("Constant", [], tag, value=numpy_helper.from_array(np.array(value)))

    exponent = node("Mul", [node("Cast", [t], "t", to=double),
                            const(opt.momentum_decay, "decay")], "exponent")
    factor = node("Sub", [const(1.0, "one"), node("Mul", [const(0.5, "half"), node(
        "Pow", [const(0.96, "base"), exponent], "pow")], "half_pow")], "factor")
    mu = node("Mul", [node("Cast", [momentum_name(index)], "beta1", to=double), factor], "mu")
    new = node("Mul", [name, node("CastLike", [mu, name], "mu_cast")], "new")
    out.initializers.append(numpy_helper.from_array(np.array(1.0, dtype), name))
    out.outputs.append(new)
    out.binding[name] = new
    out.roles[name] = "state"
    return new
