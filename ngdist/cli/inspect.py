"""A readable summary of a (training) model: parameters, gradients, comm nodes, buckets."""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING
from ngdist.ir.shards import file_layout
from ngdist.runtime.sharding import owners


@dataclass
class Summary:
    params: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    states: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    grads: list[str] = field(default_factory=list)
    comm: list[dict[str, Any]] = field(default_factory=list)
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
                flat = {0: "", 1: " in one flat buffer"}.get(c["flat"],
                                                             f" in {c['flat']} flat buffers")
                wire = f" ({c['bytes'] // 2:,} B on the wire as {c['compression']})" \
                    if c["compression"] != "none" else ""
                out.append(f"  {c['op']:12s} {c['name']:32s} {len(c['inputs'])} tensor(s)"
                           f"{flat}, {c['bytes']:,} B{wire}  {attrs}")
                out += [f"      {i:40s} {b:>12,} B" for i, b in c["inputs"]]
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
    producers = {o: n for n in info.algorithm.node for o in n.output if o}
    value_bytes = _value_bytes(info.algorithm)
    for n in info.algorithm.node:
        s.ops[f"{n.domain + '.' if n.domain and n.domain != PREVIEW_TRAINING else ''}"
              f"{n.op_type}"] += 1
        if n.domain == DOMAIN:
            members: list[str] = []
            flat = 0
            for i in n.input:
                fused = _flat_members(i, producers)
                flat += fused is not None
                members += fused if fused is not None else [i]
            inputs = [(m, value_bytes.get(m, sizes.get(
                m.removesuffix(".grad").removesuffix(".new"), 0))) for m in members]
            attrs = {a.name: _attr(a) for a in n.attribute}
            s.comm.append({"op": n.op_type, "name": n.name, "inputs": inputs,
                           "bytes": sum(b for _, b in inputs), "flat": flat, "attrs": attrs,
                           "compression": attrs.get("compression", "none")})
    return s


def explain(model: onnx.ModelProto, ranks: int = 2) -> list[str]:
    """Which implementation runs each comm node of a training model's step on ``ranks``
    ranks, and why: the step is planned as the runtime plans it (runtime/plan.py), and each
    node's kernel says which of its implementations takes it (AllReduce: the first of
    ``kernels.allreduce.IMPLEMENTATIONS`` that is enabled)."""
    import onnx_ir as ir

    from ngdist.ir.model import get_meta, split_training_model
    from ngdist.kernels import get_kernel
    from ngdist.runtime.plan import build_plan

    if not model.training_info:
        return ["implementations: none (a forward-only model has no comm nodes)"]
    _, step = split_training_model(model)
    plan = build_plan(ir.to_proto(step), ranks, donate=get_meta(step).binding)
    out = [f"implementations on {ranks} ranks:"]
    for node in plan.comm_nodes.values():
        spec = get_kernel(node.op_type)
        name, why = spec.explain(node, None) if spec.explain is not None else \
            (f"ngdist.{node.op_type}", "its one kernel")
        out.append(f"  {node.op_type:12s} {node.name:32s} {name}: {why}")
    if len(out) == 1:
        out.append("  (no comm nodes)")
    return out


def _flat_members(name: str, producers: dict[str, onnx.NodeProto]) -> list[str] | None:
    """The tensors of a fused bucket's flat buffer (``Concat`` of ``Reshape``s, as
    passes/bucketing.py builds it), in buffer order; None if ``name`` is no such buffer.
    A compressed bucket's ``Cast`` (and error feedback's ``Add`` of the residual) before the
    AllReduce are looked through (passes/compression.py)."""
    concat = producers.get(name)
    for op in ("Cast", "Add"):
        if concat is not None and concat.domain in ("", "ai.onnx") and concat.op_type == op:
            concat = producers.get(concat.input[0])
    if concat is None or concat.domain not in ("", "ai.onnx") or concat.op_type != "Concat":
        return None
    reshapes = [producers.get(i) for i in concat.input]
    if not all(r is not None and r.op_type == "Reshape" for r in reshapes):
        return None
    return [r.input[0] for r in reshapes if r is not None]


def _value_bytes(graph: onnx.GraphProto) -> dict[str, int]:
    """Byte size of every value whose element type and shape the graph states statically."""
    out: dict[str, int] = {}
    for v in [*graph.input, *graph.value_info, *graph.output]:
        t = v.type.tensor_type
        if not t.HasField("shape") or not t.elem_type:
            continue
        if not all(d.HasField("dim_value") for d in t.shape.dim):
            continue
        try:
            itemsize = helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
        except (KeyError, TypeError, ValueError):  # an element type numpy cannot hold
            continue
        out[v.name] = int(np.prod([d.dim_value for d in t.shape.dim], dtype=np.int64)) * itemsize
    return out


def _attr(a: onnx.AttributeProto) -> Any:
    if a.type == onnx.AttributeProto.GRAPH:  # e.g. PSPushPull's shard-update graph
        return f"<graph {a.g.name}: {len(a.g.node)} nodes>"
    v = helper.get_attribute_value(a)
    return v.decode() if isinstance(v, bytes) else v


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show parameters, gradients, comm nodes and buckets",
                       description="Summarize an ONNX model or training model.")
    p.add_argument("file")
    p.add_argument("--explain", action="store_true",
                   help="also say which implementation runs each comm node on several ranks, "
                        "and why (the first of the op's list that takes it)")
    p.add_argument("--dot", metavar="FILE",
                   help="also write the step graph as Graphviz DOT to FILE, comm nodes filled "
                        "orange and each flat bucket boxed; rendered to FILE.svg when Graphviz's "
                        "dot is installed (Netron opens the .onnx files themselves)")
    p.add_argument("--shard", choices=("optimizer", "gradients", "parameters"),
                   help="also show the shards of every bucket under this shard= level and "
                        "which rank owns which parameter elements (a file of ngdist rewrite "
                        "--shard shows its own)")
    p.add_argument("--shard-ranks", type=int, default=2, metavar="N",
                   help="with --shard: the rank count (default 2)")
    p.set_defaults(func=run)


def shard_lines(model: onnx.ModelProto, level: str, ranks: int) -> list[str]:
    """The shards and owners of a sharded file's buckets, or of a training model's under
    ``shard=level`` on ``ranks`` ranks (the sharding pass run as ``ngdist.compile`` runs
    it)."""
    from ngdist.ir.model import split_training_model
    from ngdist.passes.pipeline import run_passes
    from ngdist.ir.shards import layout

    if file_layout(model) is not None:
        return owners(file_layout(model))  # type: ignore[arg-type]
    if not model.training_info:
        return ["shards: none (a forward-only model has no optimizer state)"]
    _, step = split_training_model(model)
    plan = layout(run_passes(step, "allreduce", shard=level, shard_ranks=ranks, lower=False))
    return owners(plan) if plan is not None else ["shards: none"]

def run(args: argparse.Namespace) -> int:
    from ngdist.ir.model import load_proto
    from ngdist.passes.optimizers.describe import optimizer_lines

    model = load_proto(args.file)
    for line in summarize(model).lines():
        print(line)
    for line in optimizer_lines(model):  # its parameter groups
        print(line)
    if args.explain:
        for line in explain(model):
            print(line)
    if args.shard or file_layout(model) is not None:  # (a file of ngdist rewrite --shard)
        for line in shard_lines(model, args.shard, args.shard_ranks):
            print(line)
    if args.dot:
        from ngdist.cli.dot import write_dot

        for path in write_dot(model, args.dot):
            print(f"wrote {path}")
    return 0
