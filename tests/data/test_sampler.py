"""``ngdist.data.DistributedSampler`` and ``torch_loader``: every rank derives the same global
order and takes its contiguous slice of each global batch; ``trainer.shard`` warns once when the
ranks are handed different global batches."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ngdist.data import DistributedSampler, torch_loader
from ngdist.errors import InputError


def expected_global(n: int, batch: int, size: int, seed: int, epoch: int, shuffle: bool,
                    drop_last: bool) -> list[list[int]]:
    """The oracle, written out plainly: numpy's permutation of epoch ``epoch``, padded (or cut)
    and cut into global batches of ``batch * size``."""
    order = list(np.random.default_rng([seed, epoch]).permutation(n)) if shuffle else list(range(n))
    full = batch * size
    if drop_last:
        order = order[:n // full * full]
    else:
        while len(order) % size:
            order.append(order[len(order) - n])  # torch's padding: the first samples again
    return [[int(i) for i in order[s:s + full]] for s in range(0, len(order), full)]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 10, 64, 101])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_ranks_slices_make_up_the_global_batches(size, n, drop_last, shuffle):
    batch = 4
    if (drop_last and n < batch * size) or n < size:
        with pytest.raises(InputError):
            DistributedSampler(n, batch, rank=0, size=size, drop_last=drop_last)
        return
    for epoch in (0, 3):
        samplers = [DistributedSampler(n, batch, shuffle=shuffle, seed=7, drop_last=drop_last,
                                       rank=r, size=size) for r in range(size)]
        for s in samplers:
            s.set_epoch(epoch)
        want = expected_global(n, batch, size, 7, epoch, shuffle, drop_last)
        per_rank = [[b.tolist() for b in s] for s in samplers]
        assert all(len(p) == len(s) == len(want) for p, s in zip(per_rank, samplers))
        for step, glob in enumerate(want):
            shares = [per_rank[r][step] for r in range(size)]
            assert len({len(x) for x in shares}) == 1  # every rank the same count
            assert sum(shares, []) == glob  # contiguous slices, in rank order
        covered = {i for glob in want for i in glob}
        assert covered == set(range(n)) if not drop_last else len(covered) == len(want) * batch * size


def test_epochs_and_seeds_change_the_order_and_nothing_else_does():
    a, b = DistributedSampler(50, 5, seed=1, rank=0, size=2), DistributedSampler(50, 5, seed=1, rank=0, size=2)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    b.set_epoch(1)
    assert [x.tolist() for x in a] != [x.tolist() for x in b]
    c = DistributedSampler(50, 5, seed=2, rank=0, size=2)
    assert [x.tolist() for x in a] != [x.tolist() for x in c]


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(InputError, match="rank 2 is not below size 2"):
        DistributedSampler(10, 2, rank=2, size=2)
    with pytest.raises(InputError, match="batch_size must be an integer of at least 1, got 0"):
        DistributedSampler(10, 0, rank=0, size=1)
    with pytest.raises(InputError, match="10 samples make no whole global batch of 4 x 3 ranks"):
        DistributedSampler(10, 4, rank=0, size=3, drop_last=True)
    with pytest.raises(InputError, match="shuffle come.s. from the DistributedSampler"):
        torch_loader(list(range(10)), DistributedSampler(10, 2, rank=0, size=1), shuffle=True)


def test_the_torch_loader_gives_this_ranks_rows():
    torch = pytest.importorskip("torch")
    data = torch.arange(30, dtype=torch.float64).reshape(15, 2)
    dataset = torch.utils.data.TensorDataset(data, torch.arange(15))
    sampler = DistributedSampler(15, 3, seed=5, rank=1, size=2)
    sampler.set_epoch(2)
    loader = torch_loader(dataset, sampler)
    got = [(x.numpy(), y.numpy()) for x, y in loader]
    want = list(sampler)
    assert len(got) == len(loader) == len(want) == 3
    for (x, y), idx in zip(got, want):
        assert y.tolist() == idx.tolist() and x.tobytes() == data.numpy()[idx].tobytes()


TRAIN = """
import hashlib, json, sys
import numpy as np
import torch
import ngdist
import ngdist.zoo as zoo
from ngdist.data import DistributedSampler, load_digits, torch_loader

mode = sys.argv[1]
x, y, _, _ = load_digits()
x, y = x[:240], y[:240]
trainer = ngdist.compile(zoo.mlp((64, 16, 10)), loss="softmax_cross_entropy", labels="y",
                         optimizer=ngdist.optim.SGD(lr=0.1))
dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
seen = []
if mode == "sampler":
    sampler = DistributedSampler(len(x), 16, seed=3)
    loader = torch_loader(dataset, sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            trainer.step({"x": xb.numpy(), "y": yb.numpy()})
            seen.append([int(v) for v in yb])  # the labels stand for the rows
else:  # each rank shuffles the global batches on its own: same seed, or its rank's
    seed = 0 if mode == "same" else ngdist.rank()
    for epoch in range(2):
        g = torch.Generator().manual_seed(seed * 100 + epoch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, generator=g)
        for xb, yb in trainer.shard(loader):
            trainer.step({"x": np.asarray(xb), "y": np.asarray(yb)})
params = b"".join(v.tobytes() for _, v in sorted(trainer.parameters().items()))
with open(f"result.{ngdist.rank()}.json", "w") as fh:
    json.dump({"seen": seen, "params": hashlib.sha256(params).hexdigest()}, fh)
"""


def results(folder) -> list[dict]:
    return [json.loads((folder / f"result.{r}.json").read_text()) for r in range(2)]


def test_two_ranks_with_the_sampler_train_on_the_global_batches(ranks, tmp_path):
    proc = ranks(2, TRAIN, args=["sampler"])
    r0, r1 = results(tmp_path)
    assert r0["params"] == r1["params"]  # bit for bit
    from ngdist.data import load_digits
    y = load_digits()[1][:240]
    want = []
    for epoch in range(2):  # the oracle: one process's global batches, split in rank order
        for glob in expected_global(240, 16, 2, 3, epoch, True, False):
            want.append([int(v) for v in y[glob]])
    assert [a + b for a, b in zip(r0["seen"], r1["seen"])] == want
    assert "different global batches" not in proc.stderr


@pytest.mark.parametrize("mode", ["same", "per-rank"])
def test_shard_warns_once_when_the_ranks_global_batches_differ(ranks, tmp_path, mode):
    proc = ranks(2, TRAIN, args=[mode])
    r0, r1 = results(tmp_path)
    warning = ("the ranks hold different global batches (ranks [1] differ from rank 0 on the "
               "first one): trainer.shard gives each rank a slice of the batch it is handed, so "
               "each trains on a slice of a different batch. Shuffle with the same seed on every "
               "rank, or give each rank its own slice with ngdist.data.DistributedSampler")
    lines = [x for x in proc.stderr.splitlines() if "different global batches" in x]
    if mode == "same":
        assert lines == [] and r0["params"] == r1["params"]
    else:  # two epochs, two first batches that differ: warned once on each rank
        assert lines == [warning, warning], proc.stderr
