"""A readable summary of a (training) model: parameters, gradients, comm nodes, buckets."""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING


@dataclass
class Summary:
    params: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    states: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    grads: list[str] = field(default_factory=list)
    comm: list[dict] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)
    training: bool = False
    opsets: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"opsets: {self.opsets}",
               f"training model: {'yes' if self.training else 'no (forward only)'}"]
        total = sum(b for _, _, b in self.params)
        out.append(f"parameters: {len(self.params)} ({total:,} bytes)")
        out += [f"  {n:40s} {str(list(s)):>18s} {b:>12,} B" for n, s, b in self.params]
        if self.states:
            out.append(f"optimizer/step state: {len(self.states)} "
                       f"({sum(b for _, _, b in self.states):,} bytes)")
        if self.grads:
            out.append(f"gradients: {len(self.grads)}")
        if self.comm:
            out.append(f"comm nodes: {len(self.comm)}")
            for c in self.comm:
                attrs = " ".join(f"{k}={v}" for k, v in c["attrs"].items())
                out.append(f"  {c['op']:12s} {c['name']:32s} {len(c['inputs'])} tensor(s), "
                           f"{c['bytes']:,} B  {attrs}")
                out += [f"      {i}" for i in c["inputs"]]
        else:
            out.append("comm nodes: none")
        out.append("step ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.ops.items())))
        return out


def summarize(model: onnx.ModelProto) -> Summary:
    s = Summary(opsets={o.domain or "ai.onnx": o.version for o in model.opset_import})
    sizes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    floating: list[str] = []
    for t in model.graph.initializer:
        arr = numpy_helper.to_array(t)
        sizes[t.name], shapes[t.name] = arr.nbytes, arr.shape
        if np.issubdtype(arr.dtype, np.floating):
            floating.append(t.name)
    if not model.training_info:
        s.params = [(n, shapes[n], sizes[n]) for n in floating]
        s.ops = Counter(n.op_type for n in model.graph.node)
        return s
    s.training = True
    info = model.training_info[0]
    binding = {kv.key: kv.value for kv in info.update_binding}
    for t in info.algorithm.initializer:
        arr = numpy_helper.to_array(t)
        sizes[t.name], shapes[t.name] = arr.nbytes, arr.shape
    s.params = [(n, shapes[n], sizes[n]) for n in binding if n in
                {t.name for t in model.graph.initializer}]
    s.states = [(n, shapes[n], sizes[n]) for n in binding if n in
                {t.name for t in info.algorithm.initializer}]
    produced = {o for n in info.algorithm.node for o in n.output}
    s.grads = sorted(o for o in produced if o.endswith(".grad"))
    for n in info.algorithm.node:
        s.ops[f"{n.domain + '.' if n.domain and n.domain != PREVIEW_TRAINING else ''}"
              f"{n.op_type}"] += 1
        if n.domain == DOMAIN:
            nbytes = sum(sizes.get(i.removesuffix(".grad").removesuffix(".new"), 0)
                         for i in n.input)
            s.comm.append({"op": n.op_type, "name": n.name, "inputs": list(n.input),
                           "bytes": nbytes,
                           "attrs": {a.name: _attr(a) for a in n.attribute}})
    return s


def _attr(a: onnx.AttributeProto):
    if a.type == onnx.AttributeProto.GRAPH:  # e.g. PSPushPull's shard-update graph
        return f"<graph {a.g.name}: {len(a.g.node)} nodes>"
    v = helper.get_attribute_value(a)
    return v.decode() if isinstance(v, bytes) else v


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show parameters, gradients, comm nodes and buckets",
                       description="Summarize an ONNX model or training model.")
    p.add_argument("file")
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from ngdist.ir.model import load_proto

    for line in summarize(load_proto(args.file)).lines():
        print(line)
    return 0
