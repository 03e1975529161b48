"""The model sweep's tiny Hugging Face configs (ngdist.zoo_sweep_configs) of architectures whose
default config derives sizes the shrinking changed: each case builds, runs on its feeds in eager
torch and gives a finite loss (before its fix-up each raised while the model was built or run).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _loss(name: str) -> tuple[float, dict[str, np.ndarray]]:
    import torch
    from sweep_check import _tensors, loss_of

    from ngdist import zoo_sweep_hf as hf

    task, model_type = name.split("/")[1:]
    module, feeds, loss_fn = hf._build(task, model_type)
    with torch.no_grad():
        return float(loss_of(copy.deepcopy(module), loss_fn, _tensors(feeds))), feeds


@pytest.mark.parametrize("name", ["hf/imgcls/hgnet_v2", "hf/causal/blt"])
def test_a_config_whose_sizes_derive_from_others_builds_tiny_and_runs(name):
    """HGNetV2's head reads ``hidden_sizes[-1]``, its stages ``stage_*_channels`` (the head
    did not fit the last stage); BLT derives its global model's input projection from the
    local encoder's width (an RMSNorm of 64 met 32 features)."""
    loss, _ = _loss(name)
    assert np.isfinite(loss)


def test_an_audio_lm_without_a_placeholder_id_gets_one_inside_the_vocabulary():
    """Voxtral's config sets no ``audio_token_id`` (None: no placeholder matched, and its
    forward raised): the tiny config's is the sweep's placeholder, one per audio embedding."""
    from ngdist import zoo_sweep_hf as hf
    from ngdist.zoo_sweep_configs import tiny_config

    assert tiny_config("voxtral").audio_token_id == hf.AUDIO_TOKEN
    loss, feeds = _loss("hf/speech2seq/voxtral")
    assert np.isfinite(loss)
    assert (feeds["input_ids"] == hf.AUDIO_TOKEN).sum() > 0
