"""Gradient accumulation (passes/accumulate.py, runtime/accumulate.py): k micro-steps update as
one step on the concatenation of their batches (torch float64, within 1e-6), on one process and
on 2 ranks (allreduce and simple); the inner micro-steps send nothing and a window sends what
one step sends; a mean over counted labels is each micro-step's global mean (torch's
``loss / k``); ``sync=False`` by hand; the refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ngdist
from ngdist.errors import OptionError

nn = torch.nn
K, WINDOWS, MICRO = 4, 2, 6  # micro-steps per update, updates, samples per rank and micro-step


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def micro_batch(window: int, i: int, ranks: int) -> dict[str, np.ndarray]:
    """Micro-step ``i`` of update ``window``: the global micro-batch of every rank."""
    rng = np.random.default_rng(100 * window + i)
    n = MICRO * ranks
    return {"input": rng.standard_normal((n, 6)), "y": rng.integers(0, 4, n)}


def make_trainer(strategy: str, accumulate: int = K, loss=None, **kw):
    module = make_model()
    return ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                          loss=loss or nn.CrossEntropyLoss(), strategy=strategy,
                          accumulate=accumulate,
                          optimizer=torch.optim.Adam(module.parameters(), lr=0.01),
                          clip_grad_norm=0.5, **kw)


COUNTED = nn.CrossEntropyLoss(ignore_index=1)  # the micro-batches count 3 to 10 labels


def torch_run(ranks: int, counted: bool = False) -> dict[str, np.ndarray]:
    """One torch step per window on the concatenation of its k global micro-batches (counted:
    the mean of the micro-batches' losses, torch's ``loss / k``)."""
    ref = make_model()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for w in range(WINDOWS):
        parts = [micro_batch(w, i, ranks) for i in range(K)]
        x = torch.from_numpy(np.concatenate([p["input"] for p in parts]))
        y = torch.from_numpy(np.concatenate([p["y"] for p in parts]))
        opt.zero_grad()
        loss = sum(COUNTED(ref(torch.from_numpy(p["input"])), torch.from_numpy(p["y"]))
                   for p in parts) / K if counted else nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    return {k: v.detach().numpy() for k, v in ref.state_dict().items()}


def _close(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], tol: float = 1e-6
           ) -> None:
    for k, v in expected.items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=tol, err_msg=k)


@pytest.mark.parametrize("by_hand", [False, True])
def test_k_micro_steps_update_as_one_step_on_their_concatenation(by_hand):
    trainer = make_trainer("local")
    for w in range(WINDOWS):
        for i in range(K):
            sync = (i == K - 1) if by_hand else None
            stats = trainer.step(micro_batch(w, i, 1), sync=sync)
            assert (stats.grad_norm is None) == (i < K - 1)
    assert trainer.steps_done == WINDOWS
    _close(trainer.parameters(), torch_run(1))


def test_by_hand_a_window_may_be_shorter():
    """sync=True after 2 micro-steps averages over those 2 (a step on their concatenation)."""
    trainer = make_trainer("local")
    trainer.step(micro_batch(0, 0, 1), sync=False)
    trainer.step(micro_batch(0, 1, 1), sync=True)
    ref = make_model()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    parts = [micro_batch(0, i, 1) for i in range(2)]
    x = torch.from_numpy(np.concatenate([p["input"] for p in parts]))
    y = torch.from_numpy(np.concatenate([p["y"] for p in parts]))
    nn.functional.cross_entropy(ref(x), y).backward()
    nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    _close(trainer.parameters(), {k: v.detach().numpy() for k, v in ref.state_dict().items()})


SCRIPT = """
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import test_accumulate as T

for strategy in ("allreduce", "simple"):
    plain = T.make_trainer(strategy, accumulate=1)
    (mine,) = plain.shard([T.micro_batch(0, 0, plain.size)])
    one_step = plain.step(mine).bytes_sent
    plain.close()
    trainer = T.make_trainer(strategy)
    sent = []
    for w in range(T.WINDOWS):
        for i in range(T.K):
            (mine,) = trainer.shard([T.micro_batch(w, i, trainer.size)])
            sent.append(trainer.step(mine).bytes_sent)
    trainer.close()
    np.savez(f"{strategy}.{trainer.rank}.npz", sent=np.array(sent), one_step=one_step,
             **trainer.parameters())
trainer = T.make_trainer("allreduce", loss=T.COUNTED)
for w in range(T.WINDOWS):
    for i in range(T.K):
        (mine,) = trainer.shard([T.micro_batch(w, i, trainer.size)])
        trainer.step(mine)
np.savez(f"counted.{trainer.rank}.npz", **trainer.parameters())
"""


@pytest.mark.mpi
def test_two_ranks_send_once_per_window_and_match_torch(ranks, tmp_path):
    ranks(2, SCRIPT, args=[str(Path(__file__).parent)], timeout=200)
    expected = torch_run(2)
    for strategy in ("allreduce", "simple"):
        got = [dict(np.load(tmp_path / f"{strategy}.{r}.npz")) for r in range(2)]
        for k in expected:
            assert got[1][k].tobytes() == got[0][k].tobytes(), (strategy, k)
        _close(got[0], expected)
        for g in got:
            sent = g["sent"].reshape(WINDOWS, K)
            assert (sent[:, :-1] == 0).all(), strategy
            assert (sent[:, -1] == g["one_step"]).all() and g["one_step"] > 0, strategy
    got = [dict(np.load(tmp_path / f"counted.{r}.npz")) for r in range(2)]
    expected = torch_run(2, counted=True)
    for k in expected:
        assert got[1][k].tobytes() == got[0][k].tobytes(), k
    _close(got[0], expected)
    counts = [(micro_batch(w, i, 2)["y"][r * MICRO:(r + 1) * MICRO] != 1).sum()
              for w in range(WINDOWS) for i in range(K) for r in range(2)]
    assert len(set(counts)) > 2  # the ranks' and micro-steps' counts differ


@pytest.mark.parametrize("strategy, options, message", [
    ("ps", {}, r"accumulate=4 is not supported under strategy 'ps'"),
    ("pushsum", {}, r"accumulate=4 is not supported under strategy 'pushsum'"),
    ("allreduce", {"reproducible_micro_batch": 2}, r"cannot be combined with "
                                                   r"reproducible_micro_batch"),
])
def test_accumulation_is_refused_where_it_cannot_run(strategy, options, message):
    module = make_model()
    with pytest.raises(OptionError, match=message):
        ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64), strategy=strategy,
                       loss=nn.CrossEntropyLoss(), accumulate=K, **options,
                       optimizer=torch.optim.SGD(module.parameters(), lr=0.1))


def test_sync_needs_accumulate():
    trainer = make_trainer("local", accumulate=1)
    with pytest.raises(OptionError, match=r"step\(sync=...\) needs a trainer compiled with "
                                          r"accumulate=k"):
        trainer.step(micro_batch(0, 0, 1), sync=False)
    with pytest.raises(OptionError, match=r"accumulate must be at least 1"):
        make_trainer("local", accumulate=0)
