"""The sweep's reductions over a tensor's entries (benchmarks/sweep_steps.py and
tests/step_probe.py) take ``step_probe.CHUNK`` entries at a time: their answers equal numpy's
over the whole tensor, wherever a chunk boundary falls, with NaN and infinities as the whole
tensor's reduction treats them."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

import step_probe  # noqa: E402
import sweep_steps  # noqa: E402


@pytest.fixture(params=[1, 7, 64, 1 << 22])
def chunk(request, monkeypatch):
    monkeypatch.setattr(step_probe, "CHUNK", request.param)
    return request.param


def _pair(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    exact = rng.standard_normal((6, 5, 3))
    return (exact + 1e-3 * rng.standard_normal(exact.shape)).astype(np.float32), exact


def test_chunks_cover_every_entry_once_side_by_side(chunk):
    a = np.arange(41.0).reshape(41, 1)
    b = -a
    parts = list(step_probe.chunks(a, b))
    assert np.array_equal(np.concatenate([p[0] for p in parts]), a.ravel())
    assert np.array_equal(np.concatenate([p[1] for p in parts]), b.ravel())
    assert all(p[0].size <= chunk for p in parts)


def test_chunked_reductions_equal_the_whole_tensors(chunk):
    got, exact = _pair()
    whole = np.abs(got - exact).max() / np.abs(exact).max()
    assert step_probe.max_rel_err(got, exact) == float(whole)
    assert sweep_steps.max_off(got, exact) == float(np.abs(got - exact).max())
    keep = np.zeros(exact.shape, bool)
    keep[2, 1, 0] = keep[5, 4, 2] = True
    assert sweep_steps.max_off(got, exact, keep) == float(np.abs(got - exact)[keep].max())
    assert sweep_steps.finite_max(exact) == float(np.abs(exact).max())


def test_a_nan_or_an_infinity_anywhere_is_found_in_its_chunk(chunk):
    got, exact = _pair(1)
    got[4, 2, 1] = np.nan
    assert np.isnan(step_probe.max_rel_err(got, exact))
    assert sweep_steps.max_off(got, exact) == np.inf
    assert sweep_steps.max_off(got, exact, finite=True) == float(
        np.nanmax(np.abs(got - exact)))
    got[4, 2, 1] = exact[4, 2, 1]
    exact[3, 0, 2] = got[3, 0, 2] = np.inf  # an infinite bound that a step leaves infinite
    finite = np.isfinite(exact)
    assert sweep_steps.max_off(got, exact) == float(np.abs(got[finite] - exact[finite]).max())
    assert sweep_steps.finite_max(exact) == float(np.abs(exact[finite]).max())
    got[3, 0, 2] = 1.0  # one side infinite, the other not
    assert sweep_steps.max_off(got, exact) == np.inf
