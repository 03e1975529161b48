"""N ranks train as one process on the combined batch does, with torch itself as the oracle:
torch modules (float64) with flattened-token labels, padding tokens with ignored labels
(``ignore_index=-100``), a masked mean and ``nn.Embedding(padding_idx)``, on 2 and 4 ranks
under mpiexec, each rank fed its ``trainer.shard`` of every global batch; against torch
autograd on one process on the whole batches (models and batches: torch_rank_models.py). The
ranks of the padded cases hold very different numbers of counted tokens (20 and 3 on two
ranks; 10, 10, 3 and 0 on four)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import torch_rank_models as M

HERE = Path(__file__).resolve().parent

SCRIPT = """
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import ngdist
import torch_rank_models as M

for case in M.CASES:
    module = M.module(case)
    trainer = ngdist.compile(module, M.example(case), optimizer=M.optimizer(module),
                             **M.compile_kwargs(case))
    losses = []
    for s in range(M.STEPS):
        (shard,) = trainer.shard([M.batch(case, s)])
        losses.append(trainer.step(shard).loss)
    np.savez(f"{case}.rank{trainer.rank}.npz", losses=np.array(losses), **trainer.parameters())
"""


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_the_ranks_hold_uneven_counts():
    b = M.batch("ignored", 0)
    counted = (b["labels"] != M.IGNORE).reshape(M.SAMPLES, -1).sum(axis=1)
    assert counted.tolist() == [5, 5, 5, 5, 2, 1, 0, 0]
    np.testing.assert_array_equal(M.batch("masked", 0)["mask"], b["labels"] != M.IGNORE)


def test_the_padding_row_matters():
    """The padding row moves in ``ignored`` and stays in ``padding_idx``: both are tested."""
    for case, moves in (("ignored", True), ("padding_idx", False)):
        start = M.module(case).state_dict()["emb.weight"][M.PAD].numpy().copy()
        end = M.oracle(case)[0]["emb.weight"][M.PAD]
        assert (not np.array_equal(start, end)) == moves, case


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_ranks_train_as_torch_on_the_combined_batch(ranks, tmp_path, n):
    ranks(n, SCRIPT, args=[str(HERE)], timeout=200)
    for case in M.CASES:
        expected, expected_losses = M.oracle(case)
        got = [dict(np.load(tmp_path / f"{case}.rank{r}.npz")) for r in range(n)]
        for name, value in expected.items():
            for r in range(1, n):  # the same bytes on every rank
                assert got[r][name].tobytes() == got[0][name].tobytes(), (case, name, r)
            # float64 throughout but for the momentum, a float32 attribute of ONNX Momentum
            assert _relative(got[0][name], value) < 1e-6, (case, name)
        # each rank reports its term of the combined batch's loss: their mean is torch's loss
        losses = np.mean([g["losses"] for g in got], axis=0)
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-6, err_msg=case)
