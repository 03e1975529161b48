"""The step-time cost of computing a training graph's Sigmoids as 1 / (1 + exp(-x))
(ngdist/passes/autodiff/lowering.py) instead of onnxruntime's Sigmoid, on SiLU-heavy models;
with ``--lowering conv``, of running Convs with few output positions as one MatMul.

    python benchmarks/sigmoid_cost.py [--models tv/efficientnet_b0 timm/efficientnet_b0 llama]
        [--steps 10] [--rounds 3] [--lowering sigmoid|conv]

Per model, one process compiles two AdamW trainers (``strategy="local"``, one thread), one
with the lowering and one without it, and times ``--steps`` steps of each in turn,
``--rounds`` times, the first of each pair switching every round; it prints the median step
of each and their ratio. ``tv/...`` and ``timm/...`` are the model sweep's cases; ``llama``
is a Hugging Face Llama with a SiLU MLP (width 256, MLP 1024, 4 layers, 4 x 128 tokens).
On a loaded machine run it under ``chrt --fifo 1`` (root).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]


def _llama() -> tuple[Any, dict, Any]:
    import numpy as np
    import torch

    from ngdist.zoo_vision import import_torchvision

    import_torchvision()  # before transformers (which imports it)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, hidden_act="silu")
    inner = LlamaForCausalLM(config)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids, use_cache=False).logits.reshape(-1, 512)

    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 512, (4, 128)), "y": rng.integers(0, 512, (4 * 128,))}
    return Logits(), feeds, torch.nn.CrossEntropyLoss()


def build(name: str) -> tuple[Any, dict, Any]:
    if name == "llama":
        return _llama()
    from model_sweep import find_case

    return find_case(name, name).make()


LOWERINGS = {"sigmoid": "lower_sigmoids", "conv": "lower_short_convs"}


def trainer(module: Any, feeds: dict, loss_fn: Any, lowered: bool, which: str = "sigmoid"
            ) -> Any:
    import copy

    import torch

    import ngdist
    import ngdist.passes.autodiff.driver as driver
    from sweep_check import _tensors, module_inputs

    name = LOWERINGS[which]
    keep = getattr(driver, name)
    if not lowered:
        setattr(driver, name, lambda *args: 0)
    try:
        mine = copy.deepcopy(module)
        inputs = module_inputs(feeds, loss_fn)
        return ngdist.compile(mine, _tensors(inputs), loss=loss_fn,
                              optimizer=torch.optim.AdamW(mine.parameters(), lr=1e-4),
                              strategy="local", intra_op_threads=1, input_names=list(inputs))
    finally:
        setattr(driver, name, keep)


def measure(name: str, steps: int, rounds: int, which: str = "sigmoid") -> tuple[float, float]:
    import torch

    torch.set_num_threads(1)
    module, feeds, loss_fn = build(name)
    trainers = {flag: trainer(module, feeds, loss_fn, flag, which) for flag in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for t in trainers.values():
        t.step(feeds, fetch_stats=False)
    for r in range(rounds):
        for flag in ((False, True) if r % 2 == 0 else (True, False)):
            for _ in range(steps):
                start = time.perf_counter()
                trainers[flag].step(feeds, fetch_stats=False)
                times[flag].append(time.perf_counter() - start)
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+",
                        default=["tv/efficientnet_b0", "timm/efficientnet_b0", "llama"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lowering", choices=list(LOWERINGS), default="sigmoid")
    args = parser.parse_args(argv)
    print(f"{'model':24s} {'without ms':>11s} {'lowered ms':>14s} {'ratio':>6s}")
    for name in args.models:
        before, after = measure(name, args.steps, args.rounds, args.lowering)
        print(f"{name:24s} {before:11.2f} {after:14.2f} {after / before:6.3f}", flush=True)


if __name__ == "__main__":
    main()
