"""Language models and global batches for the multi-rank tests against torch
(test_torch_ranks.py): the ranks' script and the torch oracle build them from here.

Cases (float64, SGD with momentum); the LM's positions each see their token and the one before:
- ``flat``: output ``logits[:, :-1].reshape(-1, V)``, compiled with
  ``loss=nn.CrossEntropyLoss()``; labels ``ids[:, 1:].reshape(-1)`` (per-token rows).
- ``ignored``: the same LM computing its own loss, ``F.cross_entropy(..., ignore_index=-100)``
  over flattened labels (``loss=None``); the sequences start with padding tokens (id 0, an
  ordinary embedding row), the labels of padding are -100, and the ranks hold very different
  numbers of counted tokens (one of four ranks none at all).
- ``masked``: a masked mean ``sum(l * mask) / sum(mask)`` over the same padded batches.
- ``padding_idx``: ``ignored`` with ``nn.Embedding(padding_idx=0)``, whose padding row torch
  never changes.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

V, E, T, PAD, IGNORE = 13, 8, 6, 0, -100
CASES = ("flat", "ignored", "masked", "padding_idx")
LR, MOMENTUM, STEPS, SAMPLES = 0.5, 0.9, 3, 8


class CausalLM(nn.Module):
    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=padding_idx)
        self.mix = nn.Linear(E, E)
        self.out = nn.Linear(E, V)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Each position sees its token and the one before it (zeros before the first)."""
        h = self.emb(ids)
        h = h + torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        return self.out(torch.tanh(self.mix(h)))[:, :-1].reshape(-1, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits(ids)


class IgnoredLM(CausalLM):
    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(ids), labels, ignore_index=IGNORE)


class MaskedLM(CausalLM):
    def forward(self, ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        terms = F.cross_entropy(self.logits(ids), targets, reduction="none")
        return (terms * mask).sum() / mask.sum()


def module(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "padding_idx":
        return IgnoredLM(padding_idx=PAD).double()
    cls = {"flat": CausalLM, "ignored": IgnoredLM, "masked": MaskedLM}[case]
    return cls().double()


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)


def batch(case: str, step: int) -> dict[str, np.ndarray]:
    """The global batch of ``step``: SAMPLES sequences; for the padded cases, the first half
    full length, the others padding then 2, 1, 0 and 0 real tokens (left padding: a padding
    token feeds the position that predicts the first real one). A label counts where the token
    it predicts is real: 5, 5, 5, 5, 2, 1, 0, 0 per sample."""
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(1, V, (SAMPLES, T))
    if case == "flat":
        return {"ids": ids, "y": ids[:, 1:].reshape(-1)}
    lengths = [T] * 4 + [2, 1, 0, 0]
    for i, n in enumerate(lengths):
        ids[i, :T - n] = PAD
    real = np.arange(T)[None, :] >= T - np.array(lengths)[:, None]
    counted = real[:, 1:].reshape(-1)  # a label that is a real token
    targets = ids[:, 1:].reshape(-1)
    if case in ("ignored", "padding_idx"):
        return {"ids": ids, "labels": np.where(counted, targets, IGNORE)}
    return {"ids": ids, "targets": targets, "mask": counted.astype(np.float64)}


def example(case: str) -> tuple[torch.Tensor, ...]:
    """The module's inputs of the first batch (``flat``: the ids; its labels are ngdist's)."""
    arrays = list(batch(case, 0).values())
    return tuple(torch.from_numpy(a) for a in (arrays[:1] if case == "flat" else arrays))


def compile_kwargs(case: str) -> dict:
    """ngdist.compile's loss and input names for ``case``."""
    if case == "flat":
        return {"loss": nn.CrossEntropyLoss(), "input_names": ["ids"]}
    return {"loss": None, "input_names": list(batch(case, 0))}


def torch_loss(case: str, m: nn.Module, b: dict[str, np.ndarray]) -> torch.Tensor:
    """The loss torch computes on one process for the batch ``b``."""
    tensors = [torch.from_numpy(a) for a in b.values()]
    if case == "flat":
        return F.cross_entropy(m(tensors[0]), tensors[1])
    return m(*tensors)


def oracle(case: str) -> tuple[dict[str, np.ndarray], list[float]]:
    """Torch, one process, the combined batches: parameters after STEPS steps, and the losses."""
    m = module(case)
    opt = optimizer(m)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = torch_loss(case, m, batch(case, s))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}, losses
