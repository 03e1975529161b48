"""Ifs whose condition is a constant, inlined: torch's ``tile`` with fewer repeats than axes
exports as an If on the rank, whose branches read the tiled weight without it being one of
the If's inputs (timm's SAM2 Hiera tiles its windowed position table so). The autodiff has no
rule for If; once ``cleanup.fold_static_shapes`` has made the condition a constant, the branch
taken is spliced in its place and its ops are differentiated as any others."""
from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from ngdist.frontends.cleanup import constants, remove_dead
from ngdist.frontends.renames import rename_values


def constant_ifs(model: onnx.ModelProto) -> int:
    """Replaces every If whose condition is a constant (a Constant, or an initializer after
    ``fold_static_shapes``) by the nodes of the branch it takes, so that the autodiff sees
    the ops (torch's ``tile`` with fewer repeats than axes exports as an If on the rank).
    The branch's own values are renamed under the If's name; its outputs become the If's.
    Returns the number of Ifs inlined."""
    g, done = model.graph, 0
    while True:
        consts = constants(g)
        index = next((k for k, n in enumerate(g.node) if n.op_type == "If" and
                      n.domain in ("", "ai.onnx") and n.input[0] in consts), None)
        if index is None:
            if done:
                remove_dead(g)  # (conditions' initializers that nothing else reads)
            return done
        node = g.node[index]
        taken = bool(numpy_helper.to_array(consts[node.input[0]]).reshape(-1)[0])
        branch = next(a.g for a in node.attribute
                      if a.name == ("then_branch" if taken else "else_branch"))
        nodes = _inlined(branch, node)
        g.initializer.extend(_renamed_tensor(t, f"{node.output[0]}/{t.name}")
                             for t in branch.initializer)
        del g.node[index]
        for k, inner in enumerate(nodes):
            g.node.insert(index + k, inner)
        done += 1


def _inlined(branch: onnx.GraphProto, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``branch``'s nodes with the values it makes renamed under ``node``'s first output,
    its outputs written to ``node``'s (an Identity where an output is made elsewhere)."""
    prefix = f"{node.output[0]}/"
    made = {o for inner in branch.node for o in inner.output if o}
    names = {n: prefix + n for n in made | {t.name for t in branch.initializer}}
    outputs = {o.name: out for o, out in zip(branch.output, node.output)}
    for name, out in outputs.items():
        if name in made:
            names[name] = out
    nodes = []
    for inner in branch.node:
        copied = onnx.NodeProto()
        copied.CopyFrom(inner)
        copied.name = prefix + inner.name if inner.name else ""
        rename_values(copied, names)
        nodes.append(copied)
    nodes += [helper.make_node("Identity", [names.get(name, name)], [out],
                               name=f"{prefix}Identity_{out}")
              for name, out in outputs.items() if name not in made]
    return nodes


def _renamed_tensor(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    copied = onnx.TensorProto()
    copied.CopyFrom(tensor)
    copied.name = name
    return copied
