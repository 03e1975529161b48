"""AllReduce's ordered list of implementations (kernels/allreduce.py): which one takes a node,
that the first enabled one runs it, and ``ngdist inspect --explain``."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import ngdist
from ngdist import zoo
from ngdist.comm import LocalGroup
from ngdist.ir.domain import NO_BUCKET
from ngdist.kernels import CommFacts, CommNode, get_kernel
from ngdist.kernels import allreduce as ar
from ngdist.passes.pipeline import rewrite


class Ranks(LocalGroup):
    """A group that says it has two ranks (only asked, never communicated with)."""

    size = 2


def node(facts: CommFacts = CommFacts(donated=(True,), outputs_die=True), **attrs) -> CommNode:
    return CommNode("AllReduce", "n", attrs, ["g"], ["r"], facts=facts)


@pytest.mark.parametrize("attrs, facts, want", [
    ({"bucket": 0}, CommFacts(donated=(True,), outputs_die=True), "shared-memory"),
    ({"bucket": 0}, CommFacts(donated=(True,), replaced_next_step=True), "shared-memory"),
    ({"bucket": 0}, CommFacts(donated=(True,)), "mpi"),  # the result outlives the next step
    ({"bucket": 0}, CommFacts(outputs_die=True), "mpi"),  # the input is read by others
    ({}, CommFacts(donated=(True,), outputs_die=True), "mpi"),  # not a bucket
    ({"bucket": 0, "compression": "fp16"}, CommFacts(donated=(True,)), "compressed"),
    ({"bucket": 0, "algorithm": "ring"}, CommFacts(donated=(True,)), "algorithm"),
    ({"algorithm": "hierarchical"}, CommFacts(), "algorithm"),
    ({"algorithm": "exact"}, CommFacts(), "exact"),
])
def test_the_first_enabled_implementation_takes_the_node(attrs, facts, want):
    assert ar.choose(node(facts, **attrs), None).name == want
    assert ar.choose(node(facts, **attrs), Ranks(timeout=5)).name == want


def test_on_one_rank_shared_memory_is_not_taken():
    assert ar.choose(node(bucket=0), LocalGroup(timeout=5)).name == "mpi"
    assert node().attributes["bucket"] == NO_BUCKET


def test_an_implementation_is_one_class_and_one_line(monkeypatch):
    calls = []

    class Doubling(ar.AllReduceImpl):
        name, when = "doubling", "a test's: every element doubled"

        def enabled(self, request, group):
            return request.attributes["algorithm"] == "ring"

        def execute(self, group, nodes, inputs):
            calls.append([n.name for n in nodes])
            return [[2 * x for x in xs] for xs in inputs]

    monkeypatch.setattr(ar, "IMPLEMENTATIONS", [Doubling(), *ar.IMPLEMENTATIONS])
    x = np.arange(4, dtype=np.float32)
    out = get_kernel("AllReduce")(LocalGroup(timeout=5), node(algorithm="ring"), [x])
    assert calls == [["n"]] and np.array_equal(out[0], 2 * x)
    plain = node(algorithm="mpi")
    assert get_kernel("AllReduce")(LocalGroup(timeout=5), plain, [x])[0] is x
    assert plain.state["implementation"].name == "mpi"  # chosen once, kept by the kernel


def test_no_implementation_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ar, "IMPLEMENTATIONS", [])
    with pytest.raises(ngdist.errors.CommError, match="no AllReduce implementation takes "
                       "ngdist.AllReduce 'n'"):
        ar.choose(node(), None)


def _saved(tmp_path, **options) -> str:
    training = ngdist.to_training_model(zoo.mlp((64, 32, 10), seed=0),
                                        optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    path = tmp_path / "mlp.dist.onnx"
    onnx.save(rewrite(training, "allreduce", **options), path)
    return str(path)


@pytest.mark.parametrize("options, want", [
    ({"bucket_bytes": 1 << 20}, "shared-memory"),
    ({"bucket_bytes": 1 << 20, "all_reduce_alg": "ring"}, "algorithm"),
    ({"bucket_bytes": 1 << 20, "compression": "bf16"}, "compressed"),
])
def test_inspect_explain_names_each_comm_nodes_implementation(cli, tmp_path, options, want):
    proc = cli("inspect", _saved(tmp_path, **options), "--explain", cwd=tmp_path)
    lines = proc.stdout.splitlines()
    at = lines.index("implementations on 2 ranks:")
    (line,) = lines[at + 1:]
    impl = next(i for i in ar.IMPLEMENTATIONS if i.name == want)
    assert line.split()[:3] == ["AllReduce", "ngdist/allreduce/bucket0", f"{want}:"]
    assert line.endswith(impl.when)
