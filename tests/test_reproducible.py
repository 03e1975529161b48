"""Reproducible mode of the allreduce strategy, the single-process part: the exact
AllReduce kernel against exact sums (``math.fsum``) of awkward values and its independence of
order and grouping; the reduced gradients against ordinary allreduce and a float64 numpy
oracle of the digits MLP; a micro-batch's gradient bits in separate sessions, threads and
batch positions; the saved model, the CLI option and the error messages. The multi-rank part
(bit-for-bit on 1 to 4 ranks, checkpoints across rank counts) is in tests/test_ray_compat.py.
"""
from __future__ import annotations

import dataclasses

import math

import numpy as np
import onnx
import pytest

import ngdist
from ngdist import zoo
from ngdist.cli import main as cli_main
from ngdist.data import load_digits
from ngdist.errors import CommError, GraphError, InputError, NgdistError
from ngdist.kernels import KERNELS, CommFacts, CommNode, get_kernel
from ngdist.kernels.exact import FRACTION_BITS, HEADROOM, local_exponents, to_fixed
from ngdist.passes.pipeline import rewrite
from ngdist.comm import LocalGroup
from ngdist.compat.ray import DistributedSGD, Model

X, Y, _, _ = load_digits()
SGD = ngdist.optim.SGD(lr=0.1, momentum=0.9)


def exact(inputs: list[np.ndarray], reduction: str = "sum", stacked: bool = True
          ) -> list[np.ndarray]:
    node = CommNode("AllReduce", "test/exact", {"algorithm": "exact", "reduction": reduction},
                    facts=CommFacts(stacked=stacked))
    return get_kernel("AllReduce")(LocalGroup(), node, inputs)


def awkward_rows(k: int = 7, n: int = 300) -> np.ndarray:
    """Micro-batch values spanning 120 binades, with zeros, denormals and cancellations."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((k, n)) * np.exp2(rng.integers(-60, 60, (k, n)))
    rows[:, 0] = 0.0  # an element that is zero in every micro-batch
    rows[3, 1:40] = 0.0  # zeros among nonzero values
    rows[:, 40] = np.arange(1, k + 1) * 5e-324 * (-1) ** np.arange(k)  # float64 denormals
    rows[:, 41] = [1.0, -1.0] * (k // 2) + [0.5] * (k % 2)  # cancellation
    rows[:, 42] = 1e300 * np.arange(k)  # large
    rows[:, 43] = np.float32(1e-44) * np.arange(k)  # float32 denormals
    return rows


def test_exact_sum_of_awkward_values():
    rows = awkward_rows()
    k = rows.shape[0]
    (got,) = exact([rows])
    want = np.array([math.fsum(rows[:, j]) for j in range(rows.shape[1])])
    top = np.frexp(np.abs(rows).max(axis=0))[1]
    # each micro-value is rounded to 2^(E - F), E the element's largest exponent; then one
    # rounding to float64
    bound = k * np.exp2(top - FRACTION_BITS - 1) + np.abs(want) * 2.0 ** -52
    assert np.all(np.abs(got - want) <= bound)
    assert got[0] == 0.0 and got[40] == want[40] and got[41] == want[41] == 0.5
    assert got[43] == want[43]  # denormals are summed exactly
    # every order of the micro-batches gives the same bits, and so does every grouping: the
    # fixed-point partial sums of any split (what each rank computes) add up exactly
    perm = np.random.default_rng(1).permutation(k)
    assert np.array_equal(exact([rows[perm]])[0], got)
    exps = local_exponents(rows)
    for cut in range(1, k):
        assert np.array_equal(to_fixed(rows[:cut], exps) + to_fixed(rows[cut:], exps),
                              to_fixed(rows, exps))
    assert not np.array_equal(rows[:3].sum(0) + rows[3:].sum(0), rows.sum(0))  # floats do not
    # mean = sum / number of micro-batches, several inputs of other shapes in one bucket
    a, b = rows[:, :100].reshape(k, 4, 25), rows[:, 100:]
    mean_a, mean_b = exact([a, b], reduction="mean")
    assert mean_a.shape == (4, 25) and mean_b.shape == (200,)
    assert np.array_equal(np.concatenate([mean_a.reshape(-1), mean_b]), got / k)


def test_exact_kernel_float32_nonfinite_and_limits():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 50)) * np.exp2(rng.integers(-140, 20, (3, 50)))
         ).astype(np.float32)
    x[0, :5] = [0.0, -0.0, 1e-45, -3e-45, np.finfo(np.float32).max]
    # one micro-batch (or one unstacked value per rank) comes back bit-for-bit: 42 bits of
    # fixed point hold float32's 24, denormals included
    (one,) = exact([x[:1]])
    assert one.dtype == np.float32 and np.array_equal(one, x[0])
    assert np.array_equal(exact([x], reduction="mean", stacked=False)[0], x)
    # float32 values within 18 binades of their element's largest one are exact in 42-bit
    # fixed point: the mean of 3 micro-batches is the exact sum / 3, rounded to float32
    base = np.exp2(rng.integers(-120, 20, 50))
    sign = rng.choice([-1.0, 1.0], (3, 50))
    x = (sign * rng.uniform(1, 2, (3, 50)) * base * np.exp2(-rng.integers(0, 17, (3, 50)))
         ).astype(np.float32)
    (mean,) = exact([x], reduction="mean")
    want = np.array([math.fsum(x[:, j].astype(np.float64)) for j in range(50)]) / 3
    assert np.array_equal(mean, want.astype(np.float32))
    # a non-finite contribution makes that element NaN, and only that one
    y = x.copy()
    y[1, 7], y[2, 9] = np.inf, np.nan
    (bad,) = exact([y], reduction="mean")
    assert np.isnan(bad[[7, 9]]).all() and np.array_equal(np.delete(bad, [7, 9]),
                                                          np.delete(mean, [7, 9]))
    # more micro-batches than the headroom can sum exactly: a clear error
    with pytest.raises(CommError, match=r"exact AllReduce 'test/exact': 1048577 micro-batches "
                                        r"in one step, more than the 1048576 its int64 fixed "
                                        r"point can sum exactly; use a larger micro-batch"):
        exact([np.ones(((1 << HEADROOM) + 1, 1), np.float32)])


def mlp_oracle(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
               ) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients of the 64-128-10 ReLU MLP with mean softmax cross-entropy, float64."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x = x.astype(np.float64)
    h = np.maximum(x @ p["fc0.weight"].T + p["fc0.bias"], 0.0)
    z = h @ p["fc1.weight"].T + p["fc1.bias"]
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = len(y)
    dz = np.exp(logp)
    dz[np.arange(n), y] -= 1.0
    dz /= n
    dh = (dz @ p["fc1.weight"]) * (h > 0)
    grads = {"fc1.weight": dz.T @ h, "fc1.bias": dz.sum(0), "fc0.weight": dh.T @ x,
             "fc0.bias": dh.sum(0)}
    return float(-logp[np.arange(n), y].mean()), grads


def spy_allreduce(monkeypatch, seen: list[dict[str, np.ndarray]]) -> None:
    """Record every AllReduce's inputs and outputs by value name (single process)."""
    inner = KERNELS["AllReduce"]

    def kernel(comm, node, inputs):
        outs = inner(comm, node, inputs)
        seen.append({**{f"in:{n}": np.array(a) for n, a in zip(node.inputs, inputs)},
                     **{n: np.array(a) for n, a in zip(node.outputs, outs)}})
        return outs

    monkeypatch.setitem(KERNELS, "AllReduce", dataclasses.replace(inner, fn=kernel))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_reproducible_gradients_match_ordinary_allreduce_and_float64(monkeypatch):
    seen: list[dict[str, np.ndarray]] = []
    spy_allreduce(monkeypatch, seen)
    # the spy reads the averaged gradients in the kernel: keep the one-rank AllReduce there
    from ngdist.runtime import rewrites
    monkeypatch.setattr(rewrites.InlineAloneIdentities, "call",
                        lambda self, model: rewrites.ir.passes.PassResult(model, False))
    # one AllReduce per gradient, so that the spy sees each averaged gradient by name
    ordinary = ngdist.compile(zoo.mlp(seed=0), optimizer=SGD, bucket_bytes=0)
    repro = ngdist.compile(zoo.mlp(seed=0), optimizer=SGD, reproducible_micro_batch=4)
    assert type(repro.executor).__name__ == "MicroBatchExecutor" and repro.micro_batch == 4
    batch = {"x": X[:24], "y": Y[:24]}
    loss, oracle = mlp_oracle(repro.parameters(), X[:24], Y[:24])
    stats = [ordinary.step(batch), repro.step(batch)]
    *per_gradient, exact_ = seen
    plain, grads = {k: v for call in per_gradient for k, v in call.items()}, {}
    assert exact_["in:ngdist.loss.local"].shape == (6,)  # 6 micro-batches of 4, stacked
    assert exact_["in:fc0.weight.grad"].shape == (6, 128, 64)
    for name, want in oracle.items():
        grads[name] = got_plain, got_exact = plain[f"{name}.grad.reduced"], \
            exact_[f"{name}.grad.reduced"]
        assert got_exact.dtype == np.float32 and got_exact.shape == want.shape
        assert rel(got_plain, want) <= 1e-6 and rel(got_exact, want) <= 1e-6, name
        assert rel(got_exact, got_plain) <= 1e-6, name
    assert all(abs(s.loss - loss) <= 1e-6 * loss for s in stats)
    for i in range(1, 20):  # and trains like ordinary allreduce
        batch = {"x": X[i * 24:(i + 1) * 24], "y": Y[i * 24:(i + 1) * 24]}
        ordinary.step(batch, fetch_stats=False)
        repro.step(batch, fetch_stats=False)
    a, b = repro.parameters(), ordinary.parameters()
    assert max(rel(a[k], b[k]) for k in b) <= 1e-5


def test_a_micro_batch_has_the_same_bits_in_every_session_and_position(monkeypatch):
    """What rank-count independence rests on: a micro-batch's gradients come out bit-identical
    from another session, another thread (3 sessions running concurrently) and another
    position in the batch; and micro-batches in another order give the same step."""
    seen: list[dict[str, np.ndarray]] = []
    spy_allreduce(monkeypatch, seen)
    one = ngdist.compile(zoo.mlp(seed=0), optimizer=SGD, reproducible_micro_batch=4,
                         intra_op_threads=1)
    three = ngdist.compile(zoo.mlp(seed=0), optimizer=SGD, reproducible_micro_batch=4,
                           devices_per_worker=3)
    assert len(one.executor.towers) == 1 and len(three.executor.towers) == 3
    order = [5, 3, 0, 4, 1, 2]
    rows = np.concatenate([np.arange(4 * j, 4 * j + 4) for j in order])
    one.step({"x": X[:24], "y": Y[:24]})
    three.step({"x": X[rows], "y": Y[rows]})
    first, second = seen
    names = [k for k in first if k.startswith("in:")]
    assert len(names) == 5
    for name in names:
        for pos, j in enumerate(order):
            assert np.array_equal(first[name][j], second[name][pos]), (name, j)
    a, b = one.state_dict(), three.state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_saved_model_and_cli_option(tmp_path, capsys):
    onnx.save(zoo.mlp(seed=0), tmp_path / "mlp.onnx")
    out = tmp_path / "repro.onnx"
    assert cli_main(["rewrite", str(tmp_path / "mlp.onnx"), "-o", str(out), "--optimizer",
                     "sgd:lr=0.1,momentum=0.9", "--reproducible-micro-batch", "4"]) == 0
    assert cli_main(["inspect", str(out)]) == 0
    assert "algorithm=exact micro_batch=4" in capsys.readouterr().out
    direct = ngdist.compile(zoo.mlp(seed=0), optimizer=SGD, reproducible_micro_batch=4)
    from_file = ngdist.compile(str(out))
    assert from_file.micro_batch == 4
    for i in range(3):
        batch = {"x": X[i * 16:(i + 1) * 16], "y": Y[i * 16:(i + 1) * 16]}
        assert direct.step(batch).loss == from_file.step(batch).loss
    a, b = direct.state_dict(), from_file.state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_reproducible_mode_errors():
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, reproducible_micro_batch=4)
    with pytest.raises(InputError, match=r"reproducible mode cuts every rank's batch into "
                                         r"micro-batches of 4 samples, but this rank's batch "
                                         r"has 10; give each rank a positive multiple of 4 "
                                         r"samples"):
        tr.step({"x": X[:10], "y": Y[:10]})
    with pytest.raises(NgdistError, match=r"reproducible_micro_batch is an option of the "
                                          r"allreduce strategy, not of 'ps'"):
        ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, strategy="ps",
                       reproducible_micro_batch=4)
    with pytest.raises(NgdistError, match=r"reproducible_micro_batch needs all_reduce_alg="
                                          r"'exact' \(the only order-independent sum\), not "
                                          r"'ring'"):
        ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, all_reduce_alg="ring",
                       reproducible_micro_batch=4)
    with pytest.raises(NgdistError, match=r"reproducible_micro_batch must be a positive "
                                          r"number of samples, got -2"):
        ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, reproducible_micro_batch=-2)
    with pytest.raises(NgdistError, match=r"micro_batch \(reproducible mode\) needs "
                                          r"strategy='allreduce', not 'ps'"):
        DistributedSGD(lambda w, d: Model(zoo.mlp((64, 8, 10)), optimizer=SGD),
                       num_workers=1, strategy="ps", micro_batch=4)
    # a gradient averaged by an ordinary AllReduce would carry this rank's share of the batch
    model = rewrite(ngdist.to_training_model(zoo.mlp((64, 8, 10)), optimizer=SGD),
                    bucket_bytes=0, reproducible_micro_batch=4)
    node = next(n for n in model.training_info[0].algorithm.node
                if list(n.input) == ["fc1.bias.grad"])
    next(a for a in node.attribute if a.name == "algorithm").s = b"mpi"
    with pytest.raises(GraphError, match=r"reproducible mode: data-dependent value\(s\) "
                                         r"\['fc1.bias.grad'\] leave the forward/backward pass "
                                         r"without an exact AllReduce"):
        ngdist.compile(model)
