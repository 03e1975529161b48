"""shard= composed with compression= under real mpiexec on 2 and 4 ranks: every gradient bucket
is cast to 16 bits and ReduceScatter'ed with float32 accumulation (kernels/compressed_rs.py),
no AllReduce is left. After 12 SGD-with-momentum updates of the digits MLP, ZeRO-1 and ZeRO-3
with fp16 and bf16 equal plain allreduce with the same compression: within 1e-5 on 2 ranks (the
bound of the uncompressed sharding tests; a sum of two ranks is one float32 add rounded once,
whichever rank adds), and on 4 ranks closer to it than the compression itself moves the
parameters (the ring sums row k along ranks k+1..k, the AllReduce's ring its segments along
other orders, so the per-hop roundings differ). Ranks hold the same bytes; the bytes sent per
step are the uncompressed level's with the gradients' share scaled as the compressed
AllReduce scales its own (the parameters' AllGather stays float32)."""
from __future__ import annotations

import json
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from sharding_ranks import same_on_every_rank

from ngdist.comm.local import LocalGroup
from ngdist.errors import CommError
from ngdist.kernels import CommNode, get_kernel

SCRIPT = r"""
import json
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.ir.domain import SHARD_LAYOUT

x, y, _, _ = load_digits()
out, info = {}, {}
for comp in ("none", "fp16", "bf16"):
    for shard in ("none", "optimizer", "parameters"):
        t = ngdist.compile(zoo.mlp((64, 32, 16, 10), seed=0), loss="softmax_cross_entropy",
                           labels="y", optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                           shard=shard, compression=comp, timeout=60, bucket_bytes=2048)
        sent = set()
        for i in range(12):
            (mine,) = t.shard([(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])])
            sent.add(t.step({"x": mine[0], "y": mine[1]}).bytes_sent)
        g = t.step_model.graph
        layout = json.loads(g.metadata_props.get(SHARD_LAYOUT, '{"groups": []}'))
        info[f"{comp}.{shard}"] = {
            "sent": sorted(sent), "sizes": [grp["size"] for grp in layout["groups"]],
            "scatters": [n.attributes["compression"].value for n in g
                         if n.op_type == "ReduceScatter"],
            "allreduces": [n.name for n in g if n.op_type == "AllReduce"]}
        out.update({f"{comp}.{shard}.{n}": v for n, v in t.parameters().items()})
        t.close()
np.savez(f"params{t.rank}.npz", **out)
json.dump(info, open(f"info{t.rank}.json", "w"))
"""

LEVELS = ("optimizer", "parameters")


def _distance(params: dict[str, np.ndarray], a: str, b: str) -> float:
    """The largest parameter difference between runs ``a`` and ``b`` (``comp.shard``)."""
    names = [k[len(a) + 1:] for k in params if k.startswith(a + ".")]
    assert names, a
    return max(float(np.abs(params[f"{a}.{n}"] - params[f"{b}.{n}"]).max()) for n in names)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_compressed_shards_equal_the_compressed_allreduce(ranks, tmp_path, n):
    ranks(n, SCRIPT, timeout=240)
    params = same_on_every_rank(tmp_path, n)
    info = json.loads((tmp_path / "info0.json").read_text())
    for comp in ("fp16", "bf16"):
        moved = _distance(params, f"{comp}.none", "none.none")
        assert moved > 1e-5, (comp, moved)  # the compression acts on these parameters
        for shard in LEVELS:
            got = info[f"{comp}.{shard}"]
            assert got["scatters"] == [comp] * 5 and got["allreduces"] == [], got
            gap = _distance(params, f"{comp}.{shard}", f"{comp}.none")
            assert gap <= (1e-5 if n == 2 else moved), (comp, shard, gap, moved)
            # bytes: the float32 ReduceScatter counts half its [N, S] buffer (2 N S bytes);
            # the compressed one its ring's, scaled as the compressed AllReduce's count is
            plain = info[f"none.{shard}"]
            (sent32,), (sent16,) = plain["sent"], got["sent"]
            rs32 = 2 * n * sum(plain["sizes"])
            (ar32,), (ar16,) = info["none.none"]["sent"], info[f"{comp}.none"]["sent"]
            assert Fraction(ar16, ar32) == Fraction(n - 1, n), (ar16, ar32)
            assert sent16 == sent32 - rs32 + rs32 * Fraction(ar16, ar32), (sent16, sent32)


KERNEL = r"""
import json
import ml_dtypes
import numpy as np
import ngdist
from ngdist.comm import world_group
from ngdist.kernels import CommNode, allreduce_algs, get_kernel

rank, size = ngdist.rank(), ngdist.size()
comm = world_group(timeout=60)
kernel = get_kernel("ReduceScatter")
allreduce_algs.CHUNK_BYTES = 4096  # several chunks per row
results, sent = {}, {}
for cols in (1, 3, 5003):
    rng = np.random.default_rng(1000 * rank + cols)  # a wide range of magnitudes
    x = (rng.standard_normal((size, cols)) * 10.0 ** rng.uniform(-4, 3, (size, cols)))
    x = x.astype(np.float32)
    for compression in ("fp16", "bf16"):
        for reduction in ("sum", "mean"):
            wire = x.astype(np.float16) if compression == "fp16" else \
                x.astype(ml_dtypes.bfloat16).view(np.uint16)
            before, kept = comm.bytes_sent, wire.copy()
            node = CommNode("ReduceScatter", "test/rs", {"reduction": reduction,
                                                         "compression": compression})
            (out,) = kernel(comm, node, [wire])
            key = f"{cols}/{compression}/{reduction}"
            sent[key] = comm.bytes_sent - before
            assert out.dtype == wire.dtype and out.shape == (1, cols), (out.dtype, out.shape)
            assert wire.tobytes() == kept.tobytes()  # the input is left as it was
            results[key] = out.reshape(-1).view(np.uint16).tolist()
json.dump({"results": results, "sent": sent}, open(f"out{rank}.json", "w"))
"""


def _oracle(size: int, cols: int, compression: str, reduction: str, row: int) -> np.ndarray:
    """Row ``row`` of the ranks' sum in the ring's order ``row+1, row+2, ..., row``: each add
    in float32, rounded to 16 bits (numpy's float16, ml_dtypes' bfloat16)."""
    wide = np.float16 if compression == "fp16" else ml_dtypes.bfloat16
    xs = []
    for r in range(size):
        rng = np.random.default_rng(1000 * r + cols)
        x = rng.standard_normal((size, cols)) * 10.0 ** rng.uniform(-4, 3, (size, cols))
        xs.append(x.astype(np.float32)[row].astype(wide))
    acc = xs[(row + 1) % size]
    for s in range(2, size + 1):
        with np.errstate(over="ignore"):
            acc = (xs[(row + s) % size].astype(np.float32) + acc.astype(np.float32)).astype(wide)
    if reduction == "mean" and size > 1:
        acc = (acc.astype(np.float32) / np.float32(size)).astype(wide)
    return acc.view(np.uint16)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_16_bit_reduce_scatter_equals_the_oracle(ranks, tmp_path, size):
    ranks(size, KERNEL, timeout=90)
    for r in range(size):
        got = json.loads((tmp_path / f"out{r}.json").read_text())
        for key, bits in got["results"].items():
            cols, compression, reduction = key.split("/")
            want = _oracle(size, int(cols), compression, reduction, r)
            assert bits == want.tolist(), (r, key)
            # the ring's bytes: (p-1) rows of 16-bit values, (p-1)/p of the buffer
            assert got["sent"][key] == (size - 1) * int(cols) * 2, (r, key, got["sent"][key])


@pytest.mark.parametrize("compression, dtype, message", [
    ("fp16", np.float32, r"^ngdist.ReduceScatter 'rs' has compression='fp16' but its input is "
                         r"float32; the sharding pass casts it to float16: rewrite the model "
                         r"again instead of editing the file$"),
    ("fp8", np.float16, r"^unknown compression 'fp8' on ngdist.ReduceScatter 'rs'; choose one "
                        r"of \['bf16', 'fp16'\]$"),
])
def test_16_bit_reduce_scatter_refuses_what_the_pass_does_not_write(compression, dtype,
                                                                     message):
    node = CommNode("ReduceScatter", "rs", {"compression": compression})
    with pytest.raises(CommError, match=message):
        get_kernel("ReduceScatter")(LocalGroup(), node, [np.zeros((2, 3), dtype)])
