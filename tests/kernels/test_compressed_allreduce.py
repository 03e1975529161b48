"""The AllReduce kernel on 16-bit buffers (compression fp16 / bf16) under real mpiexec on 2 and
4 ranks: every rank holds the same bits, equal to a numpy oracle that adds in float32 and
rounds to 16 bits in the algorithm's order (float16 by numpy, bfloat16 by ml_dtypes), and the
ring puts exactly half the bytes of the float32 ring on the wire."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.mpi

SIZES = (1, 3, 1001, 20011)

SCRIPT = r"""
import json
import ml_dtypes
import numpy as np
import ngdist
from ngdist.comm import world_group
from ngdist.kernels import CommFacts, CommNode, allreduce_algs, get_kernel

rank, size = ngdist.rank(), ngdist.size()
comm = world_group(timeout=120)
kernel = get_kernel("AllReduce")
allreduce_algs.CHUNK_BYTES = 4096  # several chunks per ring segment
results, sent = {}, {}


def data(q, n):
    rng = np.random.default_rng(1000 * q + n)  # a wide range of magnitudes: rounding matters
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 3, n)).astype(np.float32)


for n in SIZES:
    for alg in ("mpi", "ring", "recursive_doubling"):
        for compression in ("fp16", "bf16"):
            for reduction in ("sum", "mean"):
                x = data(rank, n)
                wire = x.astype(np.float16) if compression == "fp16" else \
                    x.astype(ml_dtypes.bfloat16).view(np.uint16)
                node = CommNode("AllReduce", f"test/{alg}", {
                    "algorithm": alg, "reduction": reduction, "compression": compression},
                    facts=CommFacts(donated=(True,)))
                before = comm.bytes_sent
                (out,) = kernel(comm, node, [wire.reshape(-1, 1)])
                key = f"{n}/{alg}/{compression}/{reduction}"
                sent[key] = comm.bytes_sent - before
                assert out.dtype == wire.dtype and out.shape == (n, 1), (out.dtype, out.shape)
                results[key] = out.reshape(-1).view(np.uint16).tolist()
    node = CommNode("AllReduce", "test/float32", {"algorithm": "ring", "reduction": "sum"},
                    facts=CommFacts(donated=(True,)))
    before = comm.bytes_sent
    kernel(comm, node, [data(rank, n)])
    sent[f"{n}/float32 ring"] = comm.bytes_sent - before
json.dump({"results": results, "sent": sent}, open(f"out{rank}.json", "w"))
"""


def _widen(bits: np.ndarray, compression: str) -> np.ndarray:
    dtype = np.float16 if compression == "fp16" else ml_dtypes.bfloat16
    return bits.view(dtype).astype(np.float32)


def _narrow(x: np.ndarray, compression: str) -> np.ndarray:
    dtype = np.float16 if compression == "fp16" else ml_dtypes.bfloat16
    return x.astype(np.float32).astype(dtype).view(np.uint16)


def _add(a: np.ndarray, b: np.ndarray, compression: str) -> np.ndarray:
    return _narrow(_widen(a, compression) + _widen(b, compression), compression)


def _data(q: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * q + n)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 3, n)).astype(np.float32)


def oracle(xs: list[np.ndarray], alg: str, compression: str, reduction: str) -> np.ndarray:
    """The sum as the algorithm orders it. Ring: segment k (n*k//p .. n*(k+1)//p) starts at
    rank k and picks up ranks k+1, k+2, ... Recursive doubling: pairs (r, r xor 2^j), after
    folding the first 2*(p - 2^m) ranks pairwise (not needed for p = 2, 4)."""
    p, n = len(xs), xs[0].size
    if alg in ("mpi", "ring"):
        out = np.empty(n, np.uint16)
        for k in range(p):
            lo, hi = n * k // p, n * (k + 1) // p
            acc = xs[k][lo:hi]
            for j in range(1, p):
                acc = _add(acc, xs[(k + j) % p][lo:hi], compression)
            out[lo:hi] = acc
    else:
        level = list(xs)
        while len(level) > 1:
            level = [_add(level[i], level[i + 1], compression) for i in range(0, len(level), 2)]
        out = level[0]
    if reduction == "mean":
        out = _narrow(_widen(out, compression) / np.float32(p), compression)
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_16_bit_allreduce_equals_the_oracle_on_every_rank(ranks, tmp_path, size):
    ranks(size, SCRIPT.replace("SIZES", repr(SIZES)), timeout=180)
    outs = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(size)]
    keys = outs[0]["results"].keys()
    assert len(keys) == len(SIZES) * 3 * 2 * 2
    for key in keys:
        n, alg, compression, reduction = key.split("/")
        got = [np.array(o["results"][key], np.uint16) for o in outs]
        for r in range(1, size):  # bit-for-bit the same on every rank
            assert np.array_equal(got[r], got[0]), (key, r)
        xs = [_narrow(_data(q, int(n)), compression) for q in range(size)]
        want = oracle(xs, alg, compression, reduction)
        assert np.array_equal(got[0], want), (key, np.flatnonzero(got[0] != want)[:5])
        # and within the roundings of the exact sum: at most size + 1 of them, each at most
        # half a unit in the last place (float16: 2^-11 relative, bfloat16: 2^-8), plus
        # float16's subnormal spacing
        wide = [_widen(x, compression).astype(np.float64) for x in xs]
        exact, magnitude = np.sum(wide, axis=0), np.sum(np.abs(wide), axis=0)
        if reduction == "mean":
            exact, magnitude = exact / size, magnitude / size
        unit = 2.0 ** -11 if compression == "fp16" else 2.0 ** -8
        error = np.abs(_widen(got[0], compression) - exact)
        assert np.all(error <= (size + 1) * unit * magnitude + size * 2.0 ** -24), key
    for o in outs:  # the ring (also under "mpi") sends half the float32 ring's bytes
        for n in SIZES:
            float32 = o["sent"][f"{n}/float32 ring"]
            for compression in ("fp16", "bf16"):
                for alg in ("mpi", "ring"):
                    assert o["sent"][f"{n}/{alg}/{compression}/sum"] * 2 == float32
                assert o["sent"][f"{n}/recursive_doubling/{compression}/sum"] == \
                    {2: 2 * n, 4: 4 * n}[size]


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_wire_formats_round_like_numpy_and_ml_dtypes(compression):
    """Every 16-bit pattern widens exactly; float32 values of every kind (random bit
    patterns: subnormals, infinities, NaNs, values beyond the 16-bit range) round to the
    nearest 16-bit value, ties to even, as numpy (float16) and ml_dtypes (bfloat16) do."""
    from ngdist.kernels.compressed import FORMATS

    fmt = FORMATS[compression]
    dtype = np.float16 if compression == "fp16" else ml_dtypes.bfloat16
    every = np.arange(1 << 16, dtype=np.uint16)
    widened = fmt.widen(every)
    want = every.view(dtype).astype(np.float32)
    assert np.array_equal(widened, want, equal_nan=True)
    rng = np.random.default_rng(7)
    with np.errstate(all="ignore"):  # infinities and NaNs are part of the data
        x = np.concatenate([rng.integers(0, 1 << 32, 200_000, dtype=np.uint64)
                            .astype(np.uint32).view(np.float32),
                            want,  # each 16-bit value, and its float32 neighbours
                            np.nextafter(want, np.float32(np.inf)),
                            np.nextafter(want, np.float32(-np.inf))])
        expected = x.astype(dtype).view(np.uint16)
        ties = (want[:-1] + want[1:]) / 2  # float32 midpoints between neighbours: to even
    got = np.empty(x.size, np.uint16)
    fmt.narrow(x.copy(), got)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.isnan(got[nan].view(dtype).astype(np.float32)).all()
    finite = np.isfinite(ties)
    got = np.empty(int(finite.sum()), np.uint16)
    fmt.narrow(ties[finite].astype(np.float32), got)
    with np.errstate(over="ignore"):
        assert np.array_equal(got, ties[finite].astype(dtype).view(np.uint16))
    assert finite.sum() > 30_000
