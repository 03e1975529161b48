"""``ngdist inspect --dot FILE``: the step graph as Graphviz DOT, comm nodes and buckets marked.

Every node of the training step (or of the graph, for a model without training_info) is a box
labelled with its op and name; an edge per value, labelled with the value's name. Comm nodes of
the ``ngdist`` domain are filled orange and say their bucket, tensors and bytes; the nodes that
build and take apart a flat bucket (Reshape/Concat before it, Split/Reshape after it) sit in a
cluster with it. Parameters and other step inputs are ellipses. With Graphviz's ``dot`` on the
PATH the file is also rendered to ``FILE.svg``. Netron opens every .onnx file ngdist writes, for
browsing instead.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import onnx

from ngdist.ir.domain import DOMAIN
from ngdist.ir.atomic import write_atomic

logger = logging.getLogger(__name__)

COMM_STYLE = 'shape=box, style="rounded,filled", fillcolor="#f5a623"'
BUCKET_STYLE = 'graph [style="rounded,dashed", color="#f5a623"];'


def _q(text: str) -> str:
    """A DOT string: quoted, with backslashes and quotes escaped and line breaks as \\n."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _bucket_members(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """Comm node name -> the names of the nodes that fill and empty its flat buffer."""
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    out: dict[str, list[str]] = {}
    for n in graph.node:
        if n.domain != DOMAIN or len(n.input) != 1:
            continue
        members: list[str] = []
        concat = producer.get(n.input[0])
        if concat is not None and concat.op_type == "Concat":
            members.append(concat.name)
            members += [producer[i].name for i in concat.input
                        if i in producer and producer[i].op_type == "Reshape"]
        for split in consumers.get(n.output[0], []):
            if split.op_type == "Split":
                members.append(split.name)
                members += [c.name for o in split.output for c in consumers.get(o, [])
                            if c.op_type == "Reshape"]
        if members:
            out[n.name] = members
    return out


def to_dot(model: onnx.ModelProto) -> str:
    """The DOT text of the model's training step (its graph if it has no training_info)."""
    graph = model.training_info[0].algorithm if model.training_info else model.graph
    nodes = list(graph.node)
    names = [n.name or f"{n.op_type}_{k}" for k, n in enumerate(nodes)]
    producer = {o: names[k] for k, n in enumerate(nodes) for o in n.output}
    buckets = _bucket_members(graph)
    in_bucket = {m for members in buckets.values() for m in members}
    lines = [f"digraph {_q(graph.name or 'step')} {{", "  rankdir=TB;",
             '  node [shape=box, fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8];']
    sources = {i for n in nodes for i in n.input if i and i not in producer}
    for name in sorted(sources):
        lines.append(f"  {_q('in:' + name)} [label={_q(name)}, shape=ellipse];")

    def node_line(k: int) -> str:
        n = nodes[k]
        if n.domain == DOMAIN:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute
                     if a.type != onnx.AttributeProto.GRAPH}
            extra = ", ".join(f"{k}={v.decode() if isinstance(v, bytes) else v}"
                              for k, v in sorted(attrs.items()))
            label = f"ngdist.{n.op_type}\n{n.name}\n{len(n.input)} input(s)" + \
                (f"\n{extra}" if extra else "")
            return f"  {_q(names[k])} [label={_q(label)}, {COMM_STYLE}];"
        return f"  {_q(names[k])} [label={_q(n.op_type + chr(10) + (n.name or ''))}];"

    index = {name: k for k, name in enumerate(names)}
    for comm, members in buckets.items():
        lines.append(f"  subgraph {_q('cluster_' + comm)} {{")
        lines.append(f"    label={_q('bucket ' + comm)}; {BUCKET_STYLE}")
        lines += ["  " + node_line(index[m]) for m in [comm, *members] if m in index]
        lines.append("  }")
    for k in range(len(nodes)):
        if names[k] not in in_bucket and names[k] not in buckets:
            lines.append(node_line(k))
    for k, n in enumerate(nodes):
        for i in n.input:
            if not i:
                continue
            src = producer.get(i, "in:" + i)
            lines.append(f"  {_q(src)} -> {_q(names[k])} [label={_q(i)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dot(model: onnx.ModelProto, path: str | Path) -> list[Path]:
    """Write the DOT file (atomically) and, when Graphviz's ``dot`` is installed, its SVG;
    returns the files written."""
    path = Path(path)
    write_atomic(path, to_dot(model).encode())
    written = [path]
    dot = shutil.which("dot")
    if dot is None:
        logger.info("Graphviz 'dot' is not installed: wrote %s only", path)
        return written
    svg = path.with_name(path.name + ".svg")
    proc = subprocess.run([dot, "-Tsvg", str(path)], capture_output=True, timeout=120)
    if proc.returncode == 0:
        write_atomic(svg, proc.stdout)
        written.append(svg)
    else:
        logger.warning("dot could not render %s: %s", path, proc.stderr.decode()[-500:])
    return written
