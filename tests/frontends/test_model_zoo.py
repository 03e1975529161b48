"""Hugging Face transformers through the PyTorch frontend: BERT (sequence classification),
GPT-2 (LM head), T5 (encoder-decoder with labels) and LLaMA (grouped key/value heads, sdpa
attention; also with a padding mask, which takes the boolean-mask path), each built from a
small config (``ngdist.zoo_transformers``: 2 layers, hidden 32, sequence 8, batch 3, random
init, no download).

* Gradients: every parameter's gradient of the ngdist step (autodiff pass, onnxruntime)
  against torch autograd in float64, within 1e-4 relative to the largest entry of torch's
  tensor. ngdist runs in float32, and in float64 where onnxruntime has float64 kernels for
  every op (BERT's erf-GELU has none). Hugging Face computes parts in float32 even in a
  float64 model (LLaMA's RMSNorm and rotary tables, the LM losses' ``logits.float()``), so the
  float64 runs agree to ~3e-7, not to float64 precision.
* Training: 3 steps of ``torch.optim.SGD`` (momentum, lr 0.1), ``Adam`` and ``AdamW``
  (lr 1e-4) on one batch through ``ngdist.compile`` (float32) against the same steps in eager
  torch: every parameter within 1e-4 relative to its largest entry. The updates alone
  (parameter - initial value) are compared against torch in float64, within 1e-3 or 3x
  torch's own float32 error of the same update, whichever is larger: a LayerNorm weight of ~1
  moved by ~1e-4 keeps only ~3e-4 of its update in float32 (torch and ngdist alike), and Adam
  divides each gradient entry by its own RMS, so an entry's float32 error (independent
  summation orders: ~1e-5 relative on the small entries) reaches the update undamped
  (measured worst: 1.5e-4, GPT-2's position embeddings; torch in float32 is closer to
  itself in float64, same kernels). With lr 1e-3 or a new batch per step, gradients change
  sign between steps and Adam's first moment cancels, which amplifies that error ~10x (GPT-2's
  attention biases then differ by 1.4e-4 relative in the parameters themselves). Entries
  whose gradient is below float32's resolution (``_noise_elements``: key biases, zero in
  theory) are noise on both sides, which Adam turns into steps of up to ~lr: they are only
  bounded by the size of the model's other updates.
* Two ranks: LLaMA under ``allreduce`` on 2 x 2 sequences against torch on the 4 (mpiexec).
"""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

import torch  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model comes from a config, offline
import transformers  # noqa: E402,F401 - the extra CI installs
nn = torch.nn

import ngdist  # noqa: E402
from ngdist import zoo_transformers as hfzoo  # noqa: E402
from ngdist.frontends import torch as tfront  # noqa: E402
from step_probe import gradient_errors, max_rel_err, run_step  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TOL = 1e-4
UPDATE_TOL = 1e-3  # updates alone: see the module docstring
FLOAT64 = {"gpt2", "t5", "llama"}  # onnxruntime has no float64 Erf (BERT's GELU)


def make(name: str, seed: int = 0) -> nn.Module:
    module = hfzoo.build(name, seed)
    assert module.model.config._attn_implementation == "sdpa"
    return module


def torch_gradients(module: nn.Module, feeds: dict[str, np.ndarray]):
    ref = copy.deepcopy(module).double()
    loss = ref(*hfzoo.tensors(feeds))
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in ref.named_parameters()
                                  if p.grad is not None}


def test_a_bare_hugging_face_model_is_refused_with_the_wrapper_to_write():
    from ngdist.errors import GraphError

    model = make("gpt2").model
    with pytest.raises(GraphError, match=r"^GPT2LMHeadModel is a Hugging Face model: its "
                       r"forward returns a ModelOutput .* Compile a module whose forward "
                       r"returns the loss, e\.g\. forward\(self, input_ids, labels\)"):
        ngdist.compile(model, torch.zeros(2, 8, dtype=torch.int64), loss=None,
                       optimizer="sgd:lr=0.01")


GRAD_CASES = [(n, "float32") for n in hfzoo.MODELS] + [(n, "float64") for n in sorted(FLOAT64)]


@pytest.mark.parametrize("name,dtype", GRAD_CASES, ids=[f"{n}-{d}" for n, d in GRAD_CASES])
def test_gradients_match_torch_autograd(name, dtype):
    module = make(name)
    if dtype == "float64":
        module.double()
    feeds = hfzoo.batch(name)
    examples = {k: v[:2] for k, v in feeds.items()}
    model, exp = tfront.training_model(module, hfzoo.tensors(examples), loss=None,
                                       optimizer="sgd:lr=0.01")
    assert exp.input_names == list(feeds)
    got = run_step(model, feeds)
    loss, grads = torch_gradients(module, feeds)
    assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
    assert set(grads) == set(exp.params)  # every parameter, the tied LM heads once
    errors = gradient_errors(got, grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, (worst, errors[worst])


def _noise_elements(module: nn.Module, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per parameter, the entries whose float64 gradient is below 1e-6 of the model's
    largest, under float32's resolution of it: zero in theory (key biases: the softmax does
    not see a shift shared by all keys) or so small that their float32 gradients are off by
    10% or more on both sides. Adam divides such a gradient by its own magnitude (plus
    eps = 1e-8), so both sides take steps of up to ~lr in directions rounding picks."""
    _, grads = torch_gradients(module, feeds)
    largest = max(float(np.abs(g).max()) for g in grads.values())
    return {n: np.abs(g) <= 1e-6 * largest for n, g in grads.items()}


def torch_train(name: str, make_opt, steps, float64: bool = False) -> dict[str, np.ndarray]:
    ref = make(name)
    if float64:
        ref.double()
    opt = make_opt(ref.parameters())
    for feeds in steps:
        opt.zero_grad()
        ref(*hfzoo.tensors(feeds)).backward()
        opt.step()
    return {n: p.detach().numpy().astype(np.float64) for n, p in ref.named_parameters()}


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.5),  # decay visible
}
TRAIN_CASES = [(n, o) for n in ("bert", "gpt2", "t5", "llama") for o in OPTIMIZERS]


@pytest.mark.parametrize("name,opt", TRAIN_CASES, ids=[f"{n}-{o}" for n, o in TRAIN_CASES])
def test_three_optimizer_steps_match_torch(name, opt):
    make_opt = OPTIMIZERS[opt]
    steps = [hfzoo.batch(name)] * 3  # one batch: see the module docstring
    ref32, ref64 = torch_train(name, make_opt, steps), torch_train(name, make_opt, steps, True)

    module = make(name)
    before = {n: p.detach().numpy().astype(np.float64) for n, p in module.named_parameters()}
    noise = _noise_elements(module, steps[0])
    trainer = ngdist.compile(module, hfzoo.tensors({k: v[:2] for k, v in steps[0].items()}),
                             loss=None, optimizer=make_opt(module.parameters()),
                             strategy="local")
    for feeds in steps:
        trainer.step(feeds)
    trainer.to_torch()

    mine = {n: p.detach().numpy().astype(np.float64) for n, p in module.named_parameters()}
    assert set(mine) == set(ref32) == set(noise)
    moved = max(float(np.abs(ref64[n] - before[n])[~noise[n]].max(initial=0.0)) for n in mine)
    assert moved > 0
    errors = {}
    for n, value in mine.items():
        keep, step = ~noise[n], value - before[n]
        # noise entries: steps of up to ~lr under Adam, on both sides; bounded, not compared
        assert np.abs(step[noise[n]]).max(initial=0.0) <= 2 * moved, n
        if not keep.any():
            continue
        assert max_rel_err(value[keep], ref32[n][keep]) <= TOL, n
        # the updates themselves, against float64 torch; torch's own float32 error beside
        exact = (ref64[n] - before[n])[keep]
        if np.abs(exact).max() > 0:
            errors[n] = (max_rel_err(step[keep], exact),
                         max_rel_err((ref32[n] - before[n])[keep], exact))
    bad = {n: e for n, e in errors.items() if e[0] > max(UPDATE_TOL, 3 * e[1])}
    assert not bad, bad


TWO_RANK_SCRIPT = """
import hashlib
import json

import numpy as np
import torch

import ngdist
from ngdist import zoo_transformers as hfzoo

torch.set_num_threads(1)
make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
steps = [hfzoo.batch("llama", size=4, seed=seed) for seed in range(3)]
module = hfzoo.build("llama")
trainer = ngdist.compile(module, hfzoo.tensors({k: v[:2] for k, v in steps[0].items()}),
                         loss=None, optimizer=make_opt(module.parameters()), timeout=60)
for feeds in steps:
    trainer.step(next(trainer.shard([feeds])))
trainer.to_torch()
ref = hfzoo.build("llama")  # one process, the global batch of 4
opt = make_opt(ref.parameters())
for feeds in steps:
    opt.zero_grad()
    ref(*hfzoo.tensors(feeds)).backward()
    opt.step()
theirs = dict(ref.named_parameters())
errors = {}
for n, p in module.named_parameters():
    a, b = p.detach().numpy(), theirs[n].detach().numpy()
    errors[n] = float(np.abs(a - b).max() / np.abs(b).max())
with open(f"result{trainer.rank}.json", "w") as fh:  # one file a rank: no interleaved lines
    json.dump({"rank": trainer.rank, "errors": errors,
               "digest": {n: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
                          for n, p in module.named_parameters()}}, fh)
"""


@pytest.mark.mpi
def test_llama_on_two_ranks_matches_one_process_on_the_global_batch(ranks, tmp_path):
    """2 ranks (allreduce) x 2 sequences against torch on the 4 sequences: the same mean loss
    (every sequence has 8 predicted tokens), so 3 SGD steps give the same parameters."""
    import json

    proc = ranks(2, TWO_RANK_SCRIPT, timeout=240)
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout + proc.stderr
    assert results[0]["digest"] == results[1]["digest"]  # the same bytes on both ranks
    for r in results:
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOL, (worst, r["errors"][worst])
