"""Inputs with a whole number of rows per sample (per-token rows: the flattened labels
``ids[:, 1:].reshape(-1)`` of a causal language model next to its ``ids``) are a valid batch:
``trainer.step`` trains on them as torch does, and ``trainer.shard`` gives every rank the rows of
its own samples. A size that is not a whole multiple is refused."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import ngdist
from ngdist.errors import InputError

V, E, T = 11, 8, 6


class CausalLM(nn.Module):
    """Embedding -> Linear; the logits of every position but the last, one row per token."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.out = nn.Linear(E, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))[:, :-1].reshape(-1, V)


def _lm(lr: float = 0.5) -> tuple[nn.Module, ngdist.Trainer]:
    torch.manual_seed(0)
    module = CausalLM().double()
    reference = copy.deepcopy(module)
    ids = torch.randint(0, V, (4, T))
    trainer = ngdist.compile(module, (ids,), loss=nn.CrossEntropyLoss(),
                             optimizer=torch.optim.SGD(module.parameters(), lr=lr))
    return reference, trainer


def _batch(seed: int, b: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, V, (b, T))
    return {"ids": ids, "y": ids[:, 1:].reshape(-1)}


def test_causal_lm_trains_as_torch_does():
    """Flattened-token labels (B*(T-1) rows for B samples) through trainer.step, three SGD
    steps against torch autograd in float64 on the same batches."""
    reference, trainer = _lm()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for s in range(3):
        batch = _batch(s, 4)
        stats = trainer.step(batch)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(reference(torch.from_numpy(batch["ids"])),
                                           torch.from_numpy(batch["y"]))
        loss.backward()
        opt.step()
        assert stats.samples == 4
        assert stats.loss == pytest.approx(loss.item(), rel=1e-12)
    got = trainer.parameters()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(got[name], value.numpy(), rtol=1e-12, atol=1e-14)


def test_shard_gives_each_rank_the_rows_of_its_samples(monkeypatch):
    _, trainer = _lm()
    monkeypatch.setattr(trainer, "num_workers", 3)
    monkeypatch.setattr(trainer, "_uneven_logged", True)
    batch = _batch(0, 5)  # 5 samples over 3 ranks: 2, 2, 1 (np.array_split)
    for rank, (lo, hi) in enumerate([(0, 2), (2, 4), (4, 5)]):
        monkeypatch.setattr(type(trainer), "rank", property(lambda self, r=rank: r))
        (mine,) = trainer.shard([batch])
        np.testing.assert_array_equal(mine["ids"], batch["ids"][lo:hi])
        np.testing.assert_array_equal(mine["y"], batch["ids"][lo:hi, 1:].reshape(-1))
        (pair,) = trainer.shard([(batch["y"], batch["ids"])])  # any order, nested
        np.testing.assert_array_equal(pair[0], mine["y"])
        trainer.step(mine)  # each shard is a valid batch


def test_a_size_that_is_not_a_whole_multiple_is_refused():
    _, trainer = _lm()
    batch = _batch(0, 4)
    with pytest.raises(InputError) as err:
        trainer.step({"ids": batch["ids"], "y": batch["y"][:-1]})
    assert str(err.value) == (
        "the batch's inputs differ in size along axis 0: 'ids' has 4 samples, 'y' has 19; every "
        "input of a batch needs one row per sample")
    with pytest.raises(InputError, match=r"^the global batch's inputs differ in size along axis "
                                         r"0: 'ids' has 4 samples, 'y' has 21; every input"):
        list(trainer.shard([{"ids": batch["ids"], "y": np.arange(21)}]))
    with pytest.raises(InputError, match=r"'ids' has 4 samples, 'y' has 0"):
        trainer.step({"ids": batch["ids"], "y": batch["y"][:0]})
