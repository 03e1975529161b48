"""The model sweep's float64 oracle is float64 throughout: a Hugging Face case whose module
keeps a compute dtype of its own is built so that ``module.double()`` reaches it."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_switch_transformers_router_runs_in_the_oracles_dtype():
    """Switch Transformers' router casts its classifier to ``router_dtype`` (float32) on every
    forward: the float64 oracle's router went back to float32 mid-run (torch's AdamW then
    met float32 gradients for float64 state). The float32 model keeps float32."""
    import torch
    from sweep_check import _tensors, loss_of
    from sweep_oracle import to_float64

    from ngdist import zoo_sweep_hf as hf

    module, feeds, loss_fn = hf._build("seq2seq", "switch_transformers")
    exact = to_float64(copy.deepcopy(module))
    loss = loss_of(exact, loss_fn, _tensors(feeds, True))
    loss.backward()
    assert loss.dtype == torch.float64
    assert {p.dtype for p in exact.parameters()} == {torch.float64}
    assert {p.grad.dtype for p in exact.parameters() if p.grad is not None} == {torch.float64}
    with torch.no_grad():
        loss_of(module, loss_fn, _tensors(feeds))
    assert {p.dtype for p in module.parameters()} == {torch.float32}
