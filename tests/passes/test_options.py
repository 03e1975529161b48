"""Typed strategy options (passes/options.py) and the pass pipeline that takes them."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import ngdist
from ngdist import zoo
from ngdist.ir.model import split_training_model
from ngdist.passes.options import (AllReduceOptions, OptionError, PSOptions, PushSumOptions,
                                   STRATEGY_OPTIONS, cli_flag, strategy_options)
from ngdist.passes.pipeline import STRATEGIES, rewrite, run_passes

PUSHSUM = "graph, overlap, peers_per_itr, synch_freq"


def _training() -> onnx.ModelProto:
    return ngdist.to_training_model(zoo.mlp((64, 8, 10)), optimizer=ngdist.optim.SGD(lr=0.1))


def _comm_attributes(model: onnx.ModelProto) -> list[tuple[str, dict[str, object]]]:
    return [(n.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
            for n in model.training_info[0].algorithm.node if n.domain == "ngdist"]


def test_every_strategy_has_an_options_dataclass_with_its_knobs():
    assert set(STRATEGY_OPTIONS) == set(STRATEGIES)
    assert {s: c.names() for s, c in STRATEGY_OPTIONS.items()} == {
        "allreduce": ["all_reduce_alg", "bucket_bytes", "compression",
                      "compression_error_feedback", "reproducible_micro_batch", "shard",
                      "shard_ranks"],
        "pushsum": ["graph", "overlap", "peers_per_itr", "synch_freq"],
        "ps": ["grad_shard_bytes", "servers"], "simple": [], "local": []}
    assert PushSumOptions() == PushSumOptions(graph="exponential", peers_per_itr=1,
                                              overlap=False, synch_freq=0)
    assert AllReduceOptions().bucket_bytes == 25 << 20
    assert PSOptions().grad_shard_bytes == 10_000_000


def test_misspelt_option_suggests_the_closest_and_lists_the_valid_ones():
    with pytest.raises(OptionError) as exc:
        strategy_options("pushsum", {"peers_per_iter": 2})
    assert str(exc.value) == ("unknown option 'peers_per_iter' for strategy 'pushsum'; did you "
                              f"mean 'peers_per_itr'? Valid options: {PUSHSUM}")
    with pytest.raises(OptionError) as exc:
        strategy_options("allreduce", {"reproducible_microbatch": 32})
    assert str(exc.value) == (
        "unknown option 'reproducible_microbatch' for strategy 'allreduce'; did you mean "
        "'reproducible_micro_batch'? Valid options: all_reduce_alg, bucket_bytes, "
        "compression, compression_error_feedback, reproducible_micro_batch, shard, "
        "shard_ranks")
    with pytest.raises(OptionError) as exc:
        strategy_options("ps", {"colour": "red"})
    assert str(exc.value) == ("unknown option 'colour' for strategy 'ps'. Valid options: "
                              "grad_shard_bytes, servers")


def test_misspelt_option_of_another_strategy_says_whose_it_is():
    with pytest.raises(OptionError) as exc:
        strategy_options("pushsum", {"all_reduce_algo": "ring"})
    assert str(exc.value) == (
        "unknown option 'all_reduce_algo' for strategy 'pushsum'; did you mean 'all_reduce_alg' "
        f"(an option of the allreduce strategy)? Valid options: {PUSHSUM}")


def test_option_of_another_strategy_is_refused_naming_it():
    with pytest.raises(OptionError) as exc:
        strategy_options("pushsum", {"all_reduce_alg": "ring"})
    assert str(exc.value) == ("all_reduce_alg is an option of the allreduce strategy, not of "
                              f"'pushsum'; options of 'pushsum': {PUSHSUM}")
    with pytest.raises(OptionError) as exc:
        strategy_options("simple", {"bucket_bytes": 4096})
    assert str(exc.value) == ("bucket_bytes is an option of the allreduce strategy, not of "
                              "'simple'; 'simple' takes no options")
    with pytest.raises(OptionError) as exc:  # the command line spells them as flags
        strategy_options("ps", {"peers_per_itr": 2}, spell=cli_flag)
    assert str(exc.value) == ("--peers-per-itr is an option of the pushsum strategy, not of "
                              "'ps'; options of 'ps': --grad-shard-bytes, --servers")


def test_wrong_types_are_refused_with_the_expected_type():
    with pytest.raises(OptionError) as exc:
        strategy_options("pushsum", {"peers_per_itr": "two"})
    assert str(exc.value) == ("option 'peers_per_itr' of strategy 'pushsum' takes an int, got "
                              "'two' (str)")
    with pytest.raises(OptionError) as exc:
        PushSumOptions(overlap="yes")
    assert str(exc.value) == ("option 'overlap' of strategy 'pushsum' takes True or False, got "
                              "'yes' (str)")
    with pytest.raises(OptionError) as exc:  # True is no byte count
        PSOptions(grad_shard_bytes=True)
    assert str(exc.value) == ("option 'grad_shard_bytes' of strategy 'ps' takes an int, got "
                              "True (bool)")
    with pytest.raises(OptionError) as exc:
        PSOptions(grad_shard_bytes=1e7)
    assert str(exc.value) == ("option 'grad_shard_bytes' of strategy 'ps' takes an int, got "
                              "10000000.0 (float)")
    with pytest.raises(OptionError) as exc:
        AllReduceOptions(all_reduce_alg="rong")
    assert str(exc.value) == ("unknown all_reduce_alg 'rong'; choose one of ['mpi', 'ring', "
                              "'recursive_doubling', 'hierarchical', 'exact']")


def test_numpy_scalars_become_python_values():
    options = strategy_options("pushsum", {"peers_per_itr": np.int64(2),
                                           "overlap": np.bool_(True)})
    assert options == PushSumOptions(peers_per_itr=2, overlap=True)
    assert type(options.peers_per_itr) is int and type(options.overlap) is bool


def test_unknown_strategy_suggests_the_closest():
    with pytest.raises(OptionError) as exc:
        strategy_options("pushum", {})
    assert str(exc.value) == ("unknown strategy 'pushum'; did you mean 'pushsum'? Choose one "
                              "of ['allreduce', 'local', 'ps', 'pushsum', 'simple']")


def test_pipeline_refuses_unknown_options_before_running_a_pass():
    _, step = split_training_model(_training())
    nodes = len(list(step.graph))
    with pytest.raises(OptionError, match=r"did you mean 'peers_per_itr'\?"):
        run_passes(step, "pushsum", peers_per_iter=2)
    with pytest.raises(OptionError, match=r"^bucket_bytes is an option of the allreduce "
                                          r"strategy, not of 'ps'"):
        run_passes(step, "ps", bucket_bytes=4096)
    assert len(list(step.graph)) == nodes  # nothing was rewritten
    with pytest.raises(OptionError, match=r"options are given twice"):
        run_passes(step, PushSumOptions(), graph="ring")


def test_valid_options_reach_the_passes():
    out = rewrite(_training(), "pushsum", graph="ring", peers_per_itr=np.int32(2),
                  overlap=True, synch_freq=3)
    assert _comm_attributes(out) == [("PushSum", {"graph": b"ring", "peers_per_itr": 2,
                                                  "overlap": 1, "synch_freq": 3})]
    typed = rewrite(_training(), PushSumOptions(graph="ring", peers_per_itr=2, overlap=True,
                                                synch_freq=3))
    assert _comm_attributes(typed) == _comm_attributes(out)
    ring = rewrite(_training(), "allreduce", all_reduce_alg="ring", bucket_bytes=0)
    assert [op for op, _ in _comm_attributes(ring)] == ["AllReduce"] * 4  # one per gradient
    assert {attrs["algorithm"] for _, attrs in _comm_attributes(ring)} == {b"ring"}
    ps = rewrite(_training(), "ps", grad_shard_bytes=4096, servers=0)
    assert [(op, attrs["grad_shard_bytes"]) for op, attrs in _comm_attributes(ps)] == \
        [("PSPushPull", 4096)]
