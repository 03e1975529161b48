"""torchvision and timm image classifiers (random init, nothing downloaded), each wrapped so
that ``module(x, y)`` is the cross-entropy loss of its logits, for
``ngdist.compile(module, (x, y), loss=None)``.

Two sizes of every model:

* ``build(name)``: a small configuration for tests (``num_classes=10``, width multipliers,
  one or two blocks a stage, 32x32 images), a few seconds to export and run;
* ``build(name, full=True)``: torchvision's / timm's standard architecture (``resnet18``,
  ``mobilenet_v2``, ... with ``num_classes=10``) for the step-time benchmark.

Dropout and stochastic depth are set to 0 everywhere: a training step is then a deterministic
function of the weights and the batch, which torch and ngdist can both compute.

Importing torchvision: the torchvision 0.28.0 wheel on PyPI is built against the CUDA torch
2.13.0 wheel. Beside the CPU torch wheel its C++ extension loads but registers no operator,
and ``import torchvision`` fails in ``torchvision/_meta_registrations.py`` with
``RuntimeError: operator torchvision::nms does not exist`` (it registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` unconditionally). :func:`import_torchvision`
tries the plain import first; when that fails, it purges the half-imported modules and imports
again with the extension refused (``torch.ops.load_library`` raises OSError for torchvision's
library, so ``torchvision.extension._has_ops()`` is False and the other meta registrations are
skipped) and the two schemas defined in a ``torchvision`` library fragment. The
classification models use no torchvision operator; detection ops (``nms``, ``roi_align``)
are unusable in such a process. timm imports torchvision, so :func:`import_timm` goes through
the same function.

Needs ``pip install 'ngdist[torch,vision]'``.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

TORCHVISION = ("resnet", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
               "efficientnet_b0", "shufflenet_v2", "regnet_x", "regnet_y", "convnext", "vit",
               "swin")
TIMM = ("timm_resnet", "timm_mobilenetv3", "timm_convnext", "timm_vit")
MODELS = TORCHVISION + TIMM
CNNS = tuple(n for n in MODELS if "vit" not in n and "swin" not in n)
CLASSES = 10
DEPTHWISE = ("mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0",
             "shufflenet_v2", "timm_mobilenetv3")

_fragment: Any = None  # the torchvision library fragment; dropping it would undefine the ops


def import_torchvision() -> Any:
    """``import torchvision``, working around a CUDA-built wheel beside a CPU torch."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the vision zoo needs torch: pip install 'ngdist[torch,vision]'") \
            from exc
    try:
        import torchvision
        return torchvision
    except ImportError as exc:
        raise ImportError("the vision zoo needs torchvision and timm: "
                          "pip install 'ngdist[torch,vision]'") from exc
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        logger.info("import torchvision failed (%s): importing it without its C++ "
                    "extension", exc)
    for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[key]
    global _fragment
    if _fragment is None:
        _fragment = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _fragment.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    load_library = torch.ops.load_library

    def refuse_torchvision(path: Any) -> None:
        if "torchvision" in str(path):
            raise OSError(f"{path}: torchvision's extension does not match this torch")
        load_library(path)

    torch.ops.load_library = refuse_torchvision
    try:
        import torchvision
    finally:
        torch.ops.load_library = load_library
    return torchvision


def import_timm() -> Any:
    import_torchvision()
    try:
        import timm
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the vision zoo needs timm: pip install 'ngdist[torch,vision]'") \
            from exc
    return timm


def _torchvision_model(name: str, full: bool) -> Any:
    tv = import_torchvision()
    m = tv.models
    k = {"num_classes": CLASSES}
    if name == "resnet":
        from torchvision.models.resnet import BasicBlock
        return m.resnet18(**k) if full else m.ResNet(BasicBlock, [1, 1, 1, 1], **k)
    if name == "mobilenet_v2":
        return m.mobilenet_v2(width_mult=1.0 if full else 0.25, dropout=0.0, **k)
    if name.startswith("mobilenet_v3"):
        from torchvision.models.mobilenetv3 import MobileNetV3, _mobilenet_v3_conf
        setting, last = _mobilenet_v3_conf(name, width_mult=1.0 if full else 0.25)
        return MobileNetV3(setting, last, dropout=0.0, **k)
    if name == "efficientnet_b0":
        from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf
        scale = {} if full else {"width_mult": 0.25, "depth_mult": 0.25}
        setting, last = _efficientnet_conf("efficientnet_b0", **{"width_mult": 1.0,
                                                                 "depth_mult": 1.0, **scale})
        return EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0,
                            last_channel=last, **k)
    if name == "shufflenet_v2":
        return m.shufflenet_v2_x1_0(**k) if full else m.shufflenet_v2_x0_5(**k)
    if name in ("regnet_x", "regnet_y"):
        if full:
            return getattr(m, f"{name}_400mf")(**k)
        from torchvision.models.regnet import BlockParams, RegNet
        se = 0.25 if name == "regnet_y" else None
        params = BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0,
                                              group_width=8, se_ratio=se)
        return RegNet(params, stem_width=16, **k)
    if name == "convnext":
        if full:
            return m.convnext_tiny(stochastic_depth_prob=0.0, **k)
        from torchvision.models.convnext import CNBlockConfig, ConvNeXt
        return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                        stochastic_depth_prob=0.0, **k)
    if name == "vit":
        from torchvision.models.vision_transformer import VisionTransformer
        if full:  # ViT-S/16 at 64x64: 16 patches and the class token, 6 heads of 64
            vit = VisionTransformer(image_size=64, patch_size=16, num_layers=12, num_heads=6,
                                    hidden_dim=384, mlp_dim=1536, **k)
        else:
            vit = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                    hidden_dim=32, mlp_dim=64, **k)
        # torchvision zero-initializes the head: every other gradient would be zero
        import torch
        torch.nn.init.normal_(vit.heads.head.weight, std=0.02)
        return vit
    if name == "swin":
        from torchvision.models.swin_transformer import SwinTransformer
        if full:  # swin_t (whose builder fixes stochastic_depth_prob at 0.2)
            return SwinTransformer(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2],
                                   num_heads=[3, 6, 12, 24], window_size=[7, 7],
                                   stochastic_depth_prob=0.0, **k)
        return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2],
                               num_heads=[2, 4], window_size=[4, 4],
                               stochastic_depth_prob=0.0, **k)
    raise ValueError(f"unknown vision zoo model {name!r}; valid: {', '.join(MODELS)}")


def _timm_model(name: str, full: bool) -> Any:
    timm = import_timm()
    k = {"pretrained": False, "num_classes": CLASSES, "drop_rate": 0.0, "drop_path_rate": 0.0}
    if name == "timm_resnet":
        return timm.create_model("resnet18" if full else "resnet10t", **k)
    if name == "timm_mobilenetv3":
        return timm.create_model("mobilenetv3_large_100" if full else "mobilenetv3_small_050",
                                 **k)
    if name == "timm_convnext":
        return timm.create_model("convnext_atto", **k)
    if name == "timm_vit":
        if full:
            return timm.create_model("vit_small_patch16_224", img_size=64, **k)
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                 embed_dim=32, num_heads=2, **k)
    raise ValueError(f"unknown vision zoo model {name!r}; valid: {', '.join(MODELS)}")


def build(name: str, seed: int = 0, full: bool = False) -> Any:
    """The model ``name`` (one of :data:`MODELS`), initialized under
    ``torch.manual_seed(seed)`` in training mode and wrapped: ``module(x, y)`` is
    ``F.cross_entropy(model(x), y)``."""
    import torch

    class LossOf(torch.nn.Module):
        """``F.cross_entropy(model(x), y)``."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.model(x), y)

    if name not in MODELS:
        raise ValueError(f"unknown vision zoo model {name!r}; valid: {', '.join(MODELS)}")
    import_torchvision()
    torch.manual_seed(seed)
    model = (_timm_model if name in TIMM else _torchvision_model)(name, full)
    return LossOf(model).train()


def image_size(name: str, full: bool = False) -> int:
    """The side of the square images ``build(name, full=full)`` takes: 64 for the full models
    and for the small models with depthwise convolutions, else 32. Those downsample 32
    times, so at 32x32 their last stages see 1x1 maps and each depthwise channel's
    BatchNorm normalizes 4 values (one per image): a channel almost constant over them has a
    variance of ~1e-10, below eps, and its normalized values are float32 rounding noise
    (measured: MobileNetV2 gradients 7e-3 off float64, torch's own float32 as much)."""
    return 64 if full or name in DEPTHWISE else 32


def batch(name: str, size: int = 4, seed: int = 0, full: bool = False
          ) -> dict[str, np.ndarray]:
    """Random images (standard normal, NCHW float32) and class labels for ``name``."""
    side = image_size(name, full)
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((size, 3, side, side)).astype(np.float32),
            "y": rng.integers(0, CLASSES, size).astype(np.int64)}


def tensors(feeds: dict[str, np.ndarray]) -> tuple[Any, ...]:
    """The feeds as torch tensors, in order: the wrapped module's positional arguments."""
    import torch

    return tuple(torch.from_numpy(v) for v in feeds.values())
