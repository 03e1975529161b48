"""The model sweep's catalogue: torchvision and timm image classifiers (random init, nothing
downloaded, a few classes, small images), each a :class:`Case` that builds a module whose
forward returns logits, the batch it is fed and the loss people write for it
(``nn.CrossEntropyLoss()``). The Hugging Face cases are in ``ngdist.zoo_sweep_hf``;
``benchmarks/model_sweep.py`` runs them all and ``tests/zoo`` a subset.

Case names: ``tv/<constructor>`` (every classification constructor of ``torchvision.models``;
its family is the module that defines it), ``timm/<model>`` (one model a family of
``timm.list_models()``, the family being timm's module, the model its variant with the fewest
parameters), ``hf/<task>/<model_type>``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ngdist import zoo_vision as vz

logger = logging.getLogger(__name__)

CLASSES = 5
BATCH = 4
SIDE = 32
# depthwise convolutions: at 32x32 a channel's BatchNorm on the last 1x1 maps normalizes 4
# values, and float32 is noise there (zoo_vision.image_size); these get 64x64
DEPTHWISE = ("mobilenet", "efficientnet", "mnasnet", "shufflenet")
# torchvision constructors that need more than SIDE, or arguments of their own
_TV_KWARGS: dict[str, dict[str, Any]] = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
}
_TV_SIDE = {"alexnet": 64, "squeezenet1_0": 64, "squeezenet1_1": 64, "inception_v3": 80,
            "maxvit_t": 224}
_TV_VIT_SIDE = {"vit_h_14": 28}
# the fewest values a training-mode BatchNorm channel may normalize (the batch's images times
# the map's positions): over 4 (1x1 maps) a channel almost constant across the images has a
# variance below eps and its normalized values are float32 rounding noise, torch's own
# float32 gradients 0.3-1.7 off float64 (timm's inception_v3, dpn68, ghostnet_050 at 32x32)
BN_VALUES = 16
# timm models built with an argument of their own: VGG's pre-logits 7x7 convolution from 512 to
# 4096 channels holds 103 M parameters (float64 oracle, optimizer states: past the memory
# cap); a 64-channel hidden layer (mlp_ratio 1/64) holds 1.9 M (the model 11 M)
# DeepSeek's ViT family has only its 412 M-parameter size: 2 of its 24 blocks at full width
# hold 26 M (1.6 GB of float32 parameters alone had the row past the memory cap); Gemma 4's
# smallest ViT with a classifier has 167 M, 35 M in 2 blocks
_TIMM_KWARGS: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("vgg11", "vgg11_bn", "vgg13", "vgg16", "vgg19"), {"mlp_ratio": 1 / 64}),
    **dict.fromkeys(("deepseek_vit_412m", "gemma4_vit_167m"), {"depth": 2}),
}
# timm models whose patch size divides none of 32, 64, 128 (the default side, 546 for DeepSeek's
# ViT, held the row past the memory cap): the sides tried
_TIMM_SIDES: dict[str, tuple[int, ...]] = {"deepseek_vit_412m": (56,)}


@dataclasses.dataclass
class Case:
    """One model of the sweep: ``make()`` -> (module, feeds, loss); ``feeds`` holds the
    module's inputs in forward order, then the labels ``y``."""

    name: str
    family: str
    source: str
    make: Callable[[], tuple[Any, dict[str, np.ndarray], Any]]
    note: str = ""


def _torch() -> Any:
    import torch
    return torch


def _image_feeds(side: int, channels: int = 3, classes: int = CLASSES, seed: int = 0,
                 name: str = "x") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((BATCH, channels, side, side)).astype(np.float32),
            "y": rng.integers(0, classes, BATCH).astype(np.int64)}


def _no_dropout(module: Any) -> Any:
    """Dropout p=0 and stochastic depth off: a step is a deterministic function. A module's
    float ``drop_rate`` is 0 too: timm heads apply ``F.dropout(x, p=self.drop_rate)`` in their
    forward (ghostnet's default is 0.2), which no Dropout module holds."""
    torch = _torch()
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "drop_rate", None), float):
            m.drop_rate = 0.0
        kind = type(m).__name__
        for attr in ("drop_prob", "p"):
            if ("DropPath" in kind or "StochasticDepth" in kind) and \
                    isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return module.train()


def _param_count(build: Callable[[], Any]) -> int:
    """Parameters of ``build()``'s model, built on the meta device (no memory, no init)
    where it can be (a builder that reads a tensor's value is built on the CPU)."""
    torch = _torch()
    try:
        with torch.device("meta"):
            model = build()
    except NotImplementedError:
        model = build()
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- torchvision

def _tv_build(ctor: str) -> tuple[Any, dict[str, np.ndarray], Any]:
    torch = _torch()
    models = vz.import_torchvision().models
    kwargs = {"num_classes": CLASSES, **_TV_KWARGS.get(ctor, {})}
    side = _TV_SIDE.get(ctor, 2 * SIDE if ctor.startswith(DEPTHWISE) else SIDE)
    if ctor.startswith("vit_"):
        side = _TV_VIT_SIDE.get(ctor, 32)
        kwargs["image_size"] = side
    if ctor == "maxvit_t":
        kwargs["input_size"] = (side, side)
    # as timm's: the smallest of side, 2x and 4x at which every BatchNorm channel normalizes
    # BN_VALUES values (a ViT or MaxViT is built for its side)
    sides = (side,) if "image_size" in kwargs or "input_size" in kwargs else \
        (side, 2 * side, 4 * side)
    for side in sides:
        torch.manual_seed(0)
        model = models.get_model(ctor, weights=None, **kwargs)
        feeds = _image_feeds(side)
        if _fewest_bn_values(model, feeds["x"]) >= BN_VALUES:
            break
    if ctor.startswith("vit_"):  # torchvision zero-initializes the head
        torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    return _no_dropout(model), feeds, torch.nn.CrossEntropyLoss()


def torchvision_cases(all_constructors: bool = True) -> list[Case]:
    """Every classification constructor (``all_constructors``), or the smallest of each
    family (the module defining it)."""
    tv = vz.import_torchvision()
    names = tv.models.list_models(module=tv.models)
    family = {n: tv.models.get_model_builder(n).__module__.rsplit(".", 1)[-1] for n in names}
    if not all_constructors:
        best: dict[str, tuple[int, str]] = {}
        for n in names:
            size = _param_count(lambda n=n: tv.models.get_model(n, weights=None,
                                                                num_classes=CLASSES))
            if family[n] not in best or size < best[family[n]][0]:
                best[family[n]] = (size, n)
        names = sorted(n for _, n in best.values())
    return [Case(f"tv/{n}", f"tv/{family[n]}", "torchvision", lambda n=n: _tv_build(n))
            for n in names]


# --------------------------------------------------------------------------- timm

_SIZES = ("atto", "femto", "pico", "nano", "xxxs", "xxs", "tiny", "xs", "mini", "micro",
          "small", "lite", "s", "b0", "050", "075", "100", "t", "m", "base")


def _size_rank(name: str) -> int:
    """How small a timm variant's name says it is (lower: smaller; unnamed sizes last)."""
    tokens = name.replace("-", "_").replace(".", "_").split("_")
    ranks = [_SIZES.index(t) for t in tokens if t in _SIZES]
    return min(ranks, default=len(_SIZES))


def _timm_families(cache: Path | None, candidates: int = 4) -> dict[str, str]:
    """timm module -> its model with the fewest parameters among the ``candidates`` whose names
    say they are smallest (counted on the meta device; cached in ``cache``)."""
    timm = vz.import_timm()
    if cache is not None and cache.exists():
        return json.loads(cache.read_text())
    chosen: dict[str, str] = {}
    for module in timm.list_modules():
        names = sorted(timm.list_models(module=module), key=lambda n: (_size_rank(n), len(n), n))
        sizes = []
        for name in names[:candidates]:
            try:
                with _torch().device("meta"):
                    model = timm.create_model(name, pretrained=False, num_classes=CLASSES)
                if getattr(model, "num_classes", CLASSES) != CLASSES:
                    continue  # an encoder without a classifier (timm's gemma4_vit_167m_enc)
                sizes.append((sum(p.numel() for p in model.parameters()), name))
            except Exception as exc:  # noqa: BLE001 - a variant that needs arguments: skip it
                logger.info("timm %s: %s", name, exc)
        if sizes:
            chosen[module] = min(sizes)[1]
    if cache is not None:
        cache.write_text(json.dumps(chosen, indent=1, sort_keys=True))
    return chosen


def _timm_build(name: str) -> tuple[Any, dict[str, np.ndarray], Any]:
    torch = _torch()
    timm = vz.import_timm()
    cfg = timm.get_pretrained_cfg(name)
    channels, *default = cfg.input_size if cfg is not None else (3, 224, 224)
    kwargs = {"pretrained": False, "num_classes": CLASSES, **_TIMM_KWARGS.get(name, {})}
    # the smallest that runs, each side told to the model where it takes one: 32, then 64
    # and 128 (window and block sizes that need more, e.g. halonet's; BatchNorms over 1x1
    # maps), then the default (256 held halonet at 13 GB resident)
    tries = [(side, extra) for side in _TIMM_SIDES.get(name, (SIDE, 2 * SIDE, 4 * SIDE))
             for extra in ({"img_size": side}, {})]
    for side, extra in [*tries, (default[0], {})]:
        torch.manual_seed(0)
        try:
            model = timm.create_model(name, **kwargs, **extra)
            feeds = _image_feeds(side, channels)
            fewest = _fewest_bn_values(model, feeds["x"])
        except (TypeError, RuntimeError, ValueError, AssertionError) as exc:
            logger.info("timm %s at %d (%s): %s", name, side, extra, exc)
            continue
        if fewest < BN_VALUES and side < default[0]:
            logger.info("timm %s at %d: a BatchNorm normalizes %d values", name, side, fewest)
            continue
        return _no_dropout(model), feeds, torch.nn.CrossEntropyLoss()
    raise RuntimeError(f"timm {name}: no input size of {SIDE} or {default[0]} runs")


def _fewest_bn_values(model: Any, images: np.ndarray) -> int:
    """Runs ``model`` (eval mode, no gradient) on two of ``images`` and returns the fewest
    values one channel of its BatchNorms would normalize on the whole batch (``images``'
    count times the channel's positions; a large number where it has none). A BatchNorm of
    [N, C] features normalizes the batch alone at any side: not counted."""
    torch = _torch()
    counts: list[int] = []

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        x = args[0]
        if x.dim() > 2:
            counts.append(len(images) * (x.numel() // (2 * x.shape[1])))

    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    handles = [m.register_forward_pre_hook(hook) for m in bns]
    try:
        with torch.no_grad():
            model.eval()(torch.from_numpy(images[:2]))
    finally:
        for h in handles:
            h.remove()
    return min(counts, default=1 << 30)


def timm_cases(cache: Path | None = None) -> list[Case]:
    return [Case(f"timm/{model}", f"timm/{module}", "timm",
                 lambda m=model: _timm_build(m))
            for module, model in sorted(_timm_families(cache).items())]
