"""The shard layout of a sharded step (``shard=``; passes/shard.py writes it): per bucket, which
flat input (``[1, S]`` on each rank) holds which parameters' optimizer state (and, ZeRO-3,
which holds the parameters themselves), in flat order, ``L`` elements zero-padded to ``N * S``;
rank r holds elements ``[r*S, r*S + S)`` of each.

It rides in the step graph's metadata (``ngdist.shard_layout``). A file written by ``ngdist
rewrite --shard`` carries it in the model's metadata, and each flat input's initializer there
is the whole padded flat (``N * S`` elements, :func:`pack`), from which every rank takes its
slice when training starts (:func:`unpack`).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from ngdist.ir.domain import SHARD_LAYOUT

Flat = tuple[str, dict[str, Any], list[str]]


def layout(step: ir.Model) -> dict[str, Any] | None:
    """The shard layout of a step graph, None for an unsharded one."""
    text = step.graph.metadata_props.get(SHARD_LAYOUT)
    return json.loads(text) if text else None


def file_layout(model: onnx.ModelProto) -> dict[str, Any] | None:
    """The shard layout of a file written by ``ngdist rewrite --shard``, else None."""
    text = next((p.value for p in model.metadata_props if p.key == SHARD_LAYOUT), None)
    return json.loads(text) if text else None


def flats(plan: Mapping[str, Any], states: bool = True) -> Iterator[Flat]:
    """(flat input, its bucket's layout, the per-parameter tensors it holds in order) for
    every ZeRO-3 parameter shard and, with ``states``, every flat optimizer state."""
    for group in plan["groups"]:
        if "param" in group:
            yield group["param"], group, [p["param"] for p in group["params"]]
        if states:
            for kind, name in group["states"].items():
                yield name, group, [p["states"][kind] for p in group["params"]]


def padded(group: Mapping[str, Any], names: list[str], full: Mapping[str, np.ndarray],
           dtype: Any, ranks: int) -> np.ndarray:
    """The bucket's whole flat of ``N * S`` elements from the per-parameter ``full`` (zeros
    where a tensor is missing, and in the padding)."""
    flat = np.zeros(int(group["size"]) * ranks, dtype)
    offset = 0
    for p, n in zip(group["params"], names):
        count = int(p["count"])
        if n in full:
            flat[offset:offset + count] = np.reshape(full[n], -1)
        offset += count
    return flat


def rank_slice(group: Mapping[str, Any], names: list[str], full: Mapping[str, Any],
               dtype: Any, ranks: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s ``[1, S]`` slice of the bucket's padded flat (:func:`padded`), copied
    from the pieces of ``full`` (arrays, or tensors read one at a time) it covers: the whole
    flat is never made."""
    size = int(group["size"])
    lo, hi = rank * size, (rank + 1) * size
    out = np.zeros((1, size), dtype)
    offset = 0
    for p, n in zip(group["params"], names):
        count = int(p["count"])
        a, b = max(lo, offset), min(hi, offset + count)
        if n in full and a < b:
            out[0, a - lo:b - lo] = np.reshape(full[n], -1)[a - offset:b - offset]
        offset += count
    return out


def pieces(whole: np.ndarray, group: Mapping[str, Any], names: list[str]
           ) -> dict[str, np.ndarray]:
    """The per-parameter tensors of a bucket's whole flat."""
    out, offset = {}, 0
    for p, n in zip(group["params"], names):
        count = int(p["count"])
        out[n] = whole[offset:offset + count].reshape(p["shape"])
        offset += count
    return out


def pack(model: onnx.ModelProto, plan: dict[str, Any], full: Mapping[str, np.ndarray]) -> None:
    """A rewritten training model made a sharded file: the layout in its metadata, each flat
    input's initializer the whole padded flat of the per-parameter values ``full``."""
    inits = [*model.graph.initializer, *model.training_info[0].algorithm.initializer]
    by_name = {t.name: t for t in inits}
    ranks = int(plan["ranks"])
    for name, group, names in flats(plan):
        dtype = numpy_helper.to_array(by_name[name]).dtype
        by_name[name].CopyFrom(numpy_helper.from_array(
            padded(group, names, full, dtype, ranks), name))
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                        SHARD_LAYOUT: json.dumps(plan)})


def unpack(step: ir.Model, plan: dict[str, Any]) -> dict[str, np.ndarray]:
    """The per-parameter values of a sharded file's step (its whole flats); each flat input
    left as ``[1, S]`` zeros (the runtime sets each rank's slice) and the layout set on the
    step."""
    out: dict[str, np.ndarray] = {}
    for name, group, names in flats(plan):
        value = step.graph.initializers[name]
        whole = value.const_value.numpy().reshape(-1)  # type: ignore[union-attr]
        out.update(pieces(whole, group, names))
        size = int(group["size"])
        value.const_value = ir.tensor(np.zeros((1, size), whole.dtype), name=name)
        value.shape = ir.Shape([1, size])
    step.graph.metadata_props[SHARD_LAYOUT] = json.dumps(plan)
    return out
