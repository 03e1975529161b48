"""Step time of ngdist next to eager PyTorch on the model zoo.

For each model of ``ngdist.zoo_transformers`` (BERT classification, GPT-2 LM, T5
encoder-decoder, LLaMA with grouped key/value heads; width ``--width``, ``--layers`` layers,
``--batch`` x ``--length`` tokens) and of ``ngdist.zoo_vision`` (torchvision's resnet18,
mobilenet_v2, mobilenet_v3_small/large, efficientnet_b0, shufflenet_v2_x1_0,
regnet_x/y_400mf, convnext_tiny, a ViT-S/16 and swin_t; timm's resnet18,
mobilenetv3_large_100, convnext_atto and vit_small_patch16; 10 classes, ``--images`` images of
64x64, BatchNorm in training mode), the same initial weights, the same batch and
``torch.optim.AdamW``: ngdist's step (``ngdist.compile(..., strategy="local")``, one
onnxruntime intra-op thread, ``trainer.step(batch, fetch_stats=False)``) and PyTorch's
(``torch.set_num_threads(1)``; ``zero_grad``, forward, backward, ``opt.step()``), forward +
backward + optimizer step on both sides. Each round times ``--steps`` steps of one then the
other, alternating, after ``--warmup`` steps each; the best round's time per step is kept.
The table gives milliseconds per step and the ratio ngdist / PyTorch (below 1: ngdist is
faster), with the median ratio over the transformers and over the CNNs.

    python benchmarks/model_zoo.py [--models hf cnn vision bert resnet ...] [--width 256]
        [--layers 4] [--batch 8] [--length 64] [--images 8] [--steps 20] [--rounds 5]

``--models`` takes model names and the groups ``hf`` (the transformers), ``cnn`` (the vision
models without attention) and ``vision`` (all vision models); by default ``hf cnn``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ngdist import zoo_vision as vz  # noqa: E402  (imports neither torch nor torchvision)

HF_MODELS = ("bert", "gpt2", "t5", "llama")


def _timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def _hf_case(name: str, args: argparse.Namespace):
    from ngdist import zoo_transformers as hfzoo

    feeds = hfzoo.batch(name, size=args.batch, length=args.length)
    example = {k: v[:2] for k, v in feeds.items()}
    return (lambda: hfzoo.build(name, width=args.width, layers=args.layers)), feeds, example, \
        hfzoo.tensors


def _vision_case(name: str, args: argparse.Namespace):
    feeds = vz.batch(name, size=args.images, full=True)
    example = {k: v[:2] for k, v in feeds.items()}
    return (lambda: vz.build(name, full=True)), feeds, example, vz.tensors


def compare(name: str, args: argparse.Namespace) -> tuple[float, float]:
    """(ngdist seconds per step, PyTorch seconds per step), each the best of the rounds."""
    import torch

    import ngdist

    case = _hf_case if name in HF_MODELS else _vision_case
    make, feeds, example, tensors_of = case(name, args)
    tensors = tensors_of(feeds)

    def make_opt(ps):
        return torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01)

    module, eager = make(), make()
    trainer = ngdist.compile(module, tensors_of(example), loss=None,
                             optimizer=make_opt(module.parameters()),
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


def _expand(names: list[str]) -> list[str]:
    groups = {"hf": HF_MODELS, "cnn": vz.CNNS, "vision": vz.MODELS}
    out = [m for n in names for m in groups.get(n, (n,))]
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["hf", "cnn"],
                   choices=["hf", "cnn", "vision", *HF_MODELS, *vz.MODELS])
    p.add_argument("--width", type=int, default=256, help="transformers' hidden size (4 heads)")
    p.add_argument("--layers", type=int, default=4, help="transformers' layers")
    p.add_argument("--batch", type=int, default=8, help="sequences a transformer step")
    p.add_argument("--length", type=int, default=64, help="sequence length (at most 64)")
    p.add_argument("--images", type=int, default=8, help="64x64 images a vision step")
    p.add_argument("--steps", type=int, default=20, help="steps per timed round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; best is kept")
    args = p.parse_args(argv)

    import logging

    import torch
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    models = _expand(args.models)
    print(f"AdamW, one thread each, best of {args.rounds} x {args.steps} steps; "
          f"transformers: width {args.width}, {args.layers} layers, batch {args.batch} x "
          f"{args.length} tokens; vision: {args.images} images of 64x64, 10 classes")
    print(f"{'model':<18} {'ngdist ms':>10} {'torch ms':>10} {'ngdist/torch':>13}")
    ratios: dict[str, float] = {}
    for name in models:
        ng, pt = compare(name, args)
        ratios[name] = ng / pt
        print(f"{name:<18} {ng * 1e3:>10.2f} {pt * 1e3:>10.2f} {ng / pt:>13.2f}", flush=True)
    for label, group in (("median (hf)", HF_MODELS), ("median (cnn)", vz.CNNS),
                         ("median", tuple(ratios))):
        chosen = [ratios[n] for n in group if n in ratios]
        if chosen and (label == "median" or len(chosen) < len(ratios)):
            print(f"{label:<18} {'':>10} {'':>10} {statistics.median(chosen):>13.2f}")


if __name__ == "__main__":
    main()
