"""``ngdist inspect --dot``: the step graph as Graphviz DOT with comm nodes and buckets marked."""
from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import onnx

import ngdist
from ngdist import zoo
from ngdist.cli.dot import to_dot
from ngdist.passes.pipeline import rewrite


def rewritten() -> onnx.ModelProto:
    training = ngdist.to_training_model(zoo.mlp((64, 32, 10), seed=0),
                                        optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    return rewrite(training, "allreduce", bucket_bytes=1 << 20)


def test_every_node_and_value_is_drawn_and_the_bucket_is_marked():
    model = rewritten()
    graph = model.training_info[0].algorithm
    text = to_dot(model)
    assert text.startswith('digraph "') and text.rstrip().endswith("}")
    declared = set(re.findall(r'^\s*"((?:[^"\\]|\\.)*)" \[label=', text, re.M))
    edges = re.findall(r'^\s*"((?:[^"\\]|\\.)*)" -> "((?:[^"\\]|\\.)*)"', text, re.M)
    assert {n.name for n in graph.node} <= declared
    assert all(a in declared and b in declared for a, b in edges)  # no dangling edge
    assert len(edges) == sum(1 for n in graph.node for i in n.input if i)
    comm = [n for n in graph.node if n.domain == "ngdist"]
    assert len(comm) == 1
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(f'"{comm[0].name}" ['))
    assert 'fillcolor="#f5a623"' in line and "reduction=sum" in line
    cluster = text[text.index(f'subgraph "cluster_{comm[0].name}"'):]
    cluster = cluster[:cluster.index("\n  }")]
    for op in ("Concat", "Split", "Reshape"):
        assert f'label="{op}\\n' in cluster, op


def test_the_command_writes_the_file_and_renders_it_where_graphviz_is_installed(cli, tmp_path):
    path = tmp_path / "mlp.dist.onnx"
    onnx.save(rewritten(), path)
    proc = cli("inspect", str(path), "--dot", str(tmp_path / "step.dot"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tmp_path / 'step.dot'}" in proc.stdout
    assert (tmp_path / "step.dot").read_text() == to_dot(onnx.load(path))
    svg = tmp_path / "step.dot.svg"
    if shutil.which("dot"):
        assert f"wrote {svg}" in proc.stdout
        assert ET.parse(svg).getroot().tag.endswith("svg")
    else:
        assert not svg.exists()
