"""Values the TorchScript tracer took from a module's data, and the check that the exported
graph does not depend on them.

Where a forward turns tensor data into Python values (``counts.tolist()`` fed to
``torch.split``, ``int(t)``, ``t.item()``, iterating over a tensor), the tracer records the
values it saw as constants and says so in a ``torch.jit.TracerWarning``. The graph is then
right only for the example batch; the eval-mode export, which runs while the weights hold
placeholder values (frontends/torch_state.py, ``mark_unique``), bakes values computed from the
placeholders, so it is wrong even there. The same warning comes from conversions of shapes
(``x.size(0)`` as a tensor, then ``int()``), which the shape probes handle: the warning alone
cannot tell them apart.

So the TorchScript exporter notes the source lines of those warnings on the graph it returns
(frontends/torch_exporters.py), and where there are some the frontend runs the eval graph (with the
module's real weights) in onnxruntime on the example batch and on a second batch whose data
differs (``second_batch``), against torch's eval-mode forward on the same batches
(``traced_from_data``). A mismatch beyond float32 tolerance, or a run that fails, means the
trace depends on the data: the module is exported again by the dynamo exporter, which keeps
such sizes dynamic or refuses, and where that cannot export it the compile is refused naming
the source lines. Nothing runs when the tracer saw no conversion.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ngdist.errors import GraphError
from ngdist.frontends.torch_exporters import CONVERSIONS_KEY
from ngdist.frontends.torch_state import restore, snapshot

logger = logging.getLogger(__name__)

RTOL = 1e-3  # float32 graphs against torch's float32 forward
ATOL = 1e-4  # times the largest magnitude of torch's output (at least 1)


def take_conversions(*models: onnx.ModelProto) -> list[str]:
    """The source lines the exporter noted on ``models``, removed from them."""
    sites: set[str] = set()
    for model in models:
        kept = [p for p in model.metadata_props if p.key != CONVERSIONS_KEY]
        sites.update(s for p in model.metadata_props if p.key == CONVERSIONS_KEY
                     for s in p.value.splitlines())
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
    return sorted(sites)


def second_batch(feeds: Mapping[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """The example batch with other data: float inputs moved by half their spread, integer
    inputs redrawn from the values they hold (valid ids and labels, another mix of them);
    inputs of two values or fewer (masks, flags) as they are."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, v in feeds.items():
        values = np.unique(v) if v.size else v
        if v.dtype.kind == "f" and len(values) > 2:
            noise = rng.standard_normal(v.shape) * (float(np.std(v)) or 1.0) * 0.5
            out[name] = (v + noise).astype(v.dtype)
        elif v.dtype.kind in "iu" and len(values) > 2:
            out[name] = rng.choice(values, size=v.shape).astype(v.dtype)
        else:
            out[name] = v
    return out


def _torch_outputs(module: Any, feeds: Mapping[str, np.ndarray], in_names: list[str]
                   ) -> list[np.ndarray]:
    """Torch's eval-mode forward on ``feeds`` (grad mode on, as exported), its tensors in
    order; parameters, buffers and the module's mode left as they were."""
    import torch

    saved, was_training = snapshot(module), module.training
    try:
        module.eval()
        out = module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in in_names))
    finally:
        restore(module, saved)
        module.train(was_training)
    items = out if isinstance(out, (tuple, list)) else \
        list(out.values()) if isinstance(out, Mapping) else [out]
    return [t.detach().cpu().numpy() for t in items if isinstance(t, torch.Tensor)]


def _agrees(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> bool:
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False
        if w.dtype.kind not in "fc":
            if not np.array_equal(g, w):
                return False
            continue
        finite = np.abs(w[np.isfinite(w)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        if not np.allclose(g, w, rtol=RTOL, atol=ATOL * scale, equal_nan=True):
            return False
    return True


def _matches_torch(module: Any, graph: onnx.ModelProto, batches: list[dict[str, np.ndarray]],
                   in_names: list[str]) -> bool | None:
    """Whether ``graph`` computes torch's eval-mode outputs at each of ``batches`` (None:
    onnxruntime cannot load it, which is not the data's doing)."""
    from ngdist.runtime.sessions import make_session

    try:
        sess = make_session(graph, optimize=False)
    except Exception as exc:  # noqa: BLE001 - the check is skipped, the compile goes on
        logger.warning("traced-value check skipped: the eval graph does not load (%s)", exc)
        return None
    names = [o.name for o in sess.get_outputs()]
    for i, feeds in enumerate(batches):
        try:
            want = _torch_outputs(module, feeds, in_names)
        except Exception as exc:  # noqa: BLE001 - torch refuses this batch: not evidence
            logger.info("traced-value check: torch's forward fails on batch %d (%s)", i, exc)
            continue
        try:
            got = sess.run(names[:len(want)], {n: feeds[n] for n in in_names})
        except Exception as exc:  # noqa: BLE001 - a traced size that does not fit this batch
            logger.info("traced-value check: the eval graph fails on batch %d (%s)", i, exc)
            return False
        if not _agrees(got, want):
            return False
    return True


def traced_from_data(module: Any, args: tuple[Any, ...], in_names: list[str],
                     train: onnx.ModelProto, ev: onnx.ModelProto, retry: bool) -> bool:
    """True where the graphs depend on values traced from the data and ``retry`` (export
    again with the dynamo exporter); a GraphError where they do and not ``retry``; False
    where the tracer converted no tensor or the eval graph (real weights in ``ev``) computes
    torch's outputs on the example batch and on ``second_batch``'s."""
    sites = take_conversions(train, ev)
    if not sites:
        return False
    example = {n: a.detach().cpu().numpy() for n, a in zip(in_names, args)}
    if _matches_torch(module, ev, [example, second_batch(example)], in_names) is not False:
        logger.info("%s: the tracer converted tensors to Python values at %s; the eval graph "
                    "matches torch on a second batch", type(module).__name__, ", ".join(sites))
        return False
    if retry:
        logger.warning("%s: the TorchScript trace holds values taken from the example batch's "
                       "data (at %s); exporting with the dynamo exporter", type(module).__name__,
                       ", ".join(sites))
        return True
    raise GraphError(
        f"{type(module).__name__}'s exported graph holds values the tracer took from the example "
        f"batch's data (tensors converted to Python values at {', '.join(sites)}): it computes "
        "something else than torch on other batches, and the dynamo exporter could not export "
        "the module instead. Compute those values with tensor operations (no .tolist(), "
        ".item(), int() of data), or compile an ONNX file you exported yourself")
