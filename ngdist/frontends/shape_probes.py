"""Shape probes: a copy of a model whose outputs are its shape values, run in onnxruntime at
several batch sizes (``cleanup.fold_static_shapes`` folds what the runs show).

Making the session is most of a probe's cost on a large graph (onnxruntime's initialisation
grows faster than the node count: docs/benchmarks.md, "Compile time"), and the same probe is
often asked twice in one process: the eval-mode export of a module whose graph is its
training-mode one (no dropout, no BatchNorm), or the same module compiled again (another
optimizer, a second trainer). The results of the last ``CACHED`` successful probes are kept
(``CACHED_MAX_BYTES`` of values at most, the oldest dropped first: a large graph's probe
returns tens of MiB),
by a digest of everything the runs depend on (the probe graph's bytes, the values asked, every
feed and weight: name, type, shape and bytes), so a probe asked again with the same bytes gets
the same arrays, read-only, without a session. A probe that fails is run again each time, so
its warning is logged each time.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from ngdist.runtime.sessions import make_session

logger = logging.getLogger(__name__)

CACHED = 4  # probes whose results are kept
CACHED_MAX_BYTES = 256 << 20  # of all kept results together (the oldest go first)

Runs = list[dict[str, np.ndarray]]
_RESULTS: OrderedDict[bytes, Runs] = OrderedDict()


def probe_digest(probe: onnx.ModelProto, names: Sequence[str],
                 feeds: Sequence[Mapping[str, np.ndarray]],
                 weights: Mapping[str, np.ndarray]) -> bytes:
    """A digest of everything the runs of ``probe`` depend on (see the module docstring)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(probe.SerializeToString(deterministic=True))
    h.update("\0".join(names).encode())
    for arrays in (*feeds, weights):
        h.update(b"\1")
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
            h.update(repr(a.tolist()).encode() if a.dtype.hasobject else a.tobytes())
    return h.digest()


def probe_runs(probe: onnx.ModelProto, names: list[str],
               feeds: Sequence[Mapping[str, np.ndarray]], weights: Mapping[str, np.ndarray]
               ) -> Runs | None:
    """``names`` computed by ``probe`` at each of ``feeds`` (read-only arrays, kept for a probe
    asked again); None (logged) where a run fails: folding is an optimisation, the graph then
    stays as exported. A graph that runs at some of the batch sizes only holds a size traced
    from the example batch."""
    key = probe_digest(probe, names, feeds, weights)
    if key in _RESULTS:
        _RESULTS.move_to_end(key)
        logger.debug("shape probe of %d nodes: the results of the same probe before",
                     len(probe.graph.node))
        return _RESULTS[key]
    runs = _run(probe, names, feeds, weights)
    arrays = [v for r in runs or () for v in r.values()]
    if runs is not None and all(isinstance(v, np.ndarray) for v in arrays) and \
            _nbytes(runs) <= CACHED_MAX_BYTES:
        for v in arrays:
            v.setflags(write=False)
        _RESULTS[key] = runs
        while len(_RESULTS) > CACHED or sum(map(_nbytes, _RESULTS.values())) > CACHED_MAX_BYTES:
            _RESULTS.popitem(last=False)
    return runs


def _nbytes(runs: Runs) -> int:
    return sum(v.nbytes for r in runs for v in r.values())


def _run(probe: onnx.ModelProto, names: list[str], feeds: Sequence[Mapping[str, np.ndarray]],
         weights: Mapping[str, np.ndarray]) -> Runs | None:
    """The runs of ``probe`` in a session of its own (see ``probe_runs``)."""
    try:
        sess = make_session(probe, optimize=False)
    except Exception as exc:  # noqa: BLE001
        logger.warning("shape folding skipped: %s", exc)
        return None
    wanted = {i.name for i in sess.get_inputs()}
    runs: Runs = []
    failed: dict[int, str] = {}
    for f in feeds:
        batch = next((len(v) for v in f.values() if np.ndim(v)), 0)
        try:
            runs.append(dict(zip(names, sess.run(names, {**{k: v for k, v in f.items()
                                                            if k in wanted}, **weights}))))
        except Exception as exc:  # noqa: BLE001
            failed[batch] = str(exc).splitlines()[0]
    if not failed:
        return runs
    if runs:
        batch, why = next(iter(failed.items()))
        logger.warning("the exported graph does not run at a batch of %d (%s): it holds a size "
                       "traced from the example batch (len(tensor) or int(...) of a size in "
                       "the module), so it trains only at the batch sizes where it runs; "
                       "shape folding skipped", batch, why)
    else:
        logger.warning("shape folding skipped: %s", next(iter(failed.values())))
    return None
