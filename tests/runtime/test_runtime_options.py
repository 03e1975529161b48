"""The runtime options are named once (api.RuntimeOptions): ngdist.compile takes each, with
the same default, and hands them to the Trainer, which takes each by the same name."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np

import ngdist
from ngdist import zoo
from ngdist.api import RuntimeOptions
from ngdist.runtime import checkpoint
from ngdist.runtime.trainer import Trainer


def test_compile_and_the_trainer_take_every_runtime_option_with_its_default():
    compile_params = inspect.signature(ngdist.compile).parameters
    trainer_params = inspect.signature(Trainer.__init__).parameters
    for f in dataclasses.fields(RuntimeOptions):
        assert compile_params[f.name].default == f.default, f.name
        assert f.name in trainer_params, f.name
    assert RuntimeOptions().checkpoint_keep == checkpoint.DEFAULT_KEEP
    assert set(RuntimeOptions().as_kwargs()) == set(RuntimeOptions.names())


def test_compile_hands_the_options_to_the_trainer(tmp_path):
    tr = ngdist.compile(zoo.mlp((8, 4, 3), seed=0), optimizer=ngdist.optim.SGD(lr=0.1),
                        nan_check=False, checkpoint_every=5, checkpoint_dir=tmp_path,
                        checkpoint_keep=2, overlap=False, intra_op_threads=1)
    assert (tr.nan_check, tr.checkpoint_every, tr.checkpoint_keep) == (False, 5, 2)
    assert tr.checkpoint_dir == tmp_path and tr.executor.pool is None  # overlap off
    tr.step({"x": np.zeros((4, 8), np.float32), "y": np.zeros(4, np.int64)})
    tr.close()
