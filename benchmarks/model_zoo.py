"""Step time of ngdist next to eager PyTorch on the Hugging Face model zoo.

For each model of ``ngdist.zoo_transformers`` (BERT classification, GPT-2 LM, T5
encoder-decoder, LLaMA with grouped key/value heads), the same initial weights, the same batch
and ``torch.optim.AdamW``: ngdist's step (``ngdist.compile(..., strategy="local")``, one
onnxruntime intra-op thread, ``trainer.step(batch, fetch_stats=False)``) and PyTorch's
(``torch.set_num_threads(1)``; ``zero_grad``, forward, backward, ``opt.step()``), forward +
backward + optimizer step on both sides. Each round times ``--steps`` steps of one then the
other, alternating, after ``--warmup`` steps each; the best round's time per step is kept.
The table gives milliseconds per step and the ratio ngdist / PyTorch (below 1: ngdist is
faster), with the median ratio over the models.

    python benchmarks/model_zoo.py [--models bert gpt2 t5 llama] [--width 256] [--layers 4]
                                   [--batch 8] [--length 64] [--steps 20] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def compare(name: str, args: argparse.Namespace) -> tuple[float, float]:
    """(ngdist seconds per step, PyTorch seconds per step), each the best of the rounds."""
    import torch

    import ngdist
    from ngdist import zoo_transformers as hfzoo

    feeds = hfzoo.batch(name, size=args.batch, length=args.length)
    tensors = hfzoo.tensors(feeds)

    def make_opt(ps):
        return torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01)

    module = hfzoo.build(name, width=args.width, layers=args.layers)
    eager = hfzoo.build(name, width=args.width, layers=args.layers)
    trainer = ngdist.compile(module, hfzoo.tensors({k: v[:2] for k, v in feeds.items()}),
                             loss=None, optimizer=make_opt(module.parameters()),
                             strategy="local", intra_op_threads=1)
    opt = make_opt(eager.parameters())

    def ngdist_step() -> None:
        trainer.step(feeds, fetch_stats=False)

    def torch_step() -> None:
        opt.zero_grad()
        eager(*tensors).backward()
        opt.step()

    _timed(ngdist_step, args.warmup)
    _timed(torch_step, args.warmup)
    best_ng = best_pt = float("inf")
    for _ in range(args.rounds):
        best_ng = min(best_ng, _timed(ngdist_step, args.steps))
        best_pt = min(best_pt, _timed(torch_step, args.steps))
    return best_ng, best_pt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["bert", "gpt2", "t5", "llama"])
    p.add_argument("--width", type=int, default=256, help="hidden size (4 heads)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=64, help="sequence length (at most 64)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; best is kept")
    args = p.parse_args(argv)

    import logging

    import torch
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    print(f"width {args.width}, {args.layers} layers, batch {args.batch} x {args.length} "
          f"tokens, AdamW, one thread each, best of {args.rounds} x {args.steps} steps")
    print(f"{'model':<8} {'ngdist ms':>10} {'torch ms':>10} {'ngdist/torch':>13}")
    ratios = []
    for name in args.models:
        ng, pt = compare(name, args)
        ratios.append(ng / pt)
        print(f"{name:<8} {ng * 1e3:>10.2f} {pt * 1e3:>10.2f} {ng / pt:>13.2f}", flush=True)
    print(f"{'median':<8} {'':>10} {'':>10} {statistics.median(ratios):>13.2f}")


if __name__ == "__main__":
    main()
