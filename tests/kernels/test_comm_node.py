"""A comm node's attributes are read once, with the op's defaults filled in (ir/domain.py):
kernels index them and never repeat a default."""
from __future__ import annotations

from onnx import helper

from ngdist.ir.domain import COMM_OPS, DOMAIN, NO_BUCKET, comm_attributes, with_defaults
from ngdist.kernels import CommNode


def test_a_comm_node_has_every_attribute_of_its_op():
    node = CommNode("AllReduce", "g", {"algorithm": "ring"})
    assert node.attributes == {"reduction": "mean", "bucket": NO_BUCKET, "algorithm": "ring",
                               "micro_batch": 0, "compression": "none"}
    assert CommNode("Broadcast", "b").attributes == {"root": 0}
    assert set(CommNode("PushSum", "p").attributes) == set(COMM_OPS["PushSum"].attributes)


def test_given_attributes_win_and_an_unknown_op_keeps_its_own():
    assert with_defaults("AllReduce", {"bucket": 0})["bucket"] == 0  # bucket 0 is a bucket
    assert with_defaults("NotAnOp", {"x": 1}) == {"x": 1}


def test_attributes_of_an_onnx_node_are_decoded_and_completed():
    n = helper.make_node("AllReduce", ["a"], ["b"], domain=DOMAIN, algorithm="exact",
                         micro_batch=4)
    assert comm_attributes(n) == {"reduction": "mean", "bucket": NO_BUCKET,
                                  "algorithm": "exact", "micro_batch": 4,
                                  "compression": "none"}
