"""The graph's shapes are probed with the example batch, cycled to each probe batch size, at
every fold (the export's and the training model's): inputs made up from the declared types
(zeros for indices and masks) can drive a model into values it never meets (an empty
selection, a count of zero) on which onnxruntime fails, or dies of SIGFPE (Longformer: no
token with global attention). A graph that runs at the example's batch size only (a size
traced as a constant, Longformer's ``len(nonzero)``) is said so by name."""
from __future__ import annotations

import logging

import numpy as np
import torch

from ngdist.frontends import torch as tfront

LOGGER = "ngdist.frontends.cleanup"


class GlobalRows(torch.nn.Module):
    """Longformer's pattern in small: the rows of the tokens with global attention (the
    first of each kept sample) viewed to ``len()`` of their indices, a constant in the trace;
    and a per-sample integer scale that divides by the kept-token count."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        scale = torch.div(mask.shape[1], mask.sum(1, keepdim=True), rounding_mode="floor")
        index = mask[:, 0].nonzero()
        rows = h[index[:, 0], 0].reshape(len(index), -1)
        return self.lin(h.mean(1) * scale.float() + rows)


def _example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, 10, (3, 6), generator=gen), torch.ones(3, 6, dtype=torch.int64),
            torch.randint(0, 3, (3,), generator=gen))


def test_training_model_probes_with_the_example_batch(caplog):
    ids, mask, y = _example()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tfront.training_model(GlobalRows(), (ids, mask), loss=torch.nn.CrossEntropyLoss(),
                              input_names=["ids", "mask"], optimizer="sgd:lr=0.1")
    warned = [m for name, _, m in caplog.record_tuples if name == LOGGER]
    assert warned, "the graph runs at batch 3 only: its probes at 4 and 7 must say so"
    for message in warned:  # zeros for the mask would divide by zero (Integer division)
        assert message.startswith("the exported graph does not run at a batch of 4 ("), message
        assert message.endswith("traced from the example batch (len(tensor) or int(...) of a "
                                "size in the module), so it trains only at the batch sizes "
                                "where it runs; shape folding skipped"), message


def test_graph_traced_at_the_example_batch_trains_like_torch():
    """The compiled step at the example's batch gives torch's gradients (float64 oracle)."""
    from step_probe import gradient_errors, run_step

    ids, mask, y = _example()
    module = GlobalRows()
    model, exp = tfront.training_model(module, (ids, mask), loss=torch.nn.CrossEntropyLoss(),
                                       input_names=["ids", "mask"], optimizer="sgd:lr=0.1")
    got = run_step(model, {"ids": ids.numpy(), "mask": mask.numpy(), "y": y.numpy()})
    ref = module.double()
    loss = torch.nn.functional.cross_entropy(ref(ids, mask), y)
    loss.backward()
    exact = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert set(exact) <= set(exp.params)
    assert max(gradient_errors(got, exact).values()) < 1e-5
    assert abs(float(got["loss"]) - float(loss)) < 1e-5
