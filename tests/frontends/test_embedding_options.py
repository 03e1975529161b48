"""``nn.Embedding``'s options through the PyTorch frontend, against torch in float64.

``padding_idx``: the lookup adds nothing to the padding row's gradient, so that row changes only
through the optimizer's own terms, exactly as in torch: a zero padding row feeding a LayerNorm
with eps 1e-12 (whose input gradient there is ~1e6) stays exactly zero through SGD with
momentum and weight decay, AdamW and Adam with L2 decay, a non-zero one decays as torch decays
it, and a padding row tied to the output layer still gets that layer's gradient (also on 2
ranks under mpiexec against torch on the combined batch). ``sparse=True`` trains
as torch's sparse SGD does; ``max_norm``, ``scale_grad_by_freq``, sparse gradients with an
optimizer torch refuses them for, and ``EmbeddingBag(padding_idx)`` are refused.
"""
from __future__ import annotations

import copy
import re
import warnings

import numpy as np
import pytest
import torch

import ngdist
from ngdist.errors import GraphError
from ngdist.frontends import torch as tfront
from ngdist.frontends.torch_embedding import _TORCH_REFUSES_SPARSE
from step_probe import check_step_graph, gradient_errors, max_rel_err, run_step, torch_step

nn = torch.nn
V, D, T, PAD, CLASSES = 12, 16, 6, 0, 3
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


ENCODER_SOURCE = """
class Encoder(nn.Module):
    \"\"\"Token and position embeddings, a LayerNorm with eps 1e-12, an encoder layer, a
    head.\"\"\"

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, padding_idx=PAD, sparse=sparse)
        self.pos = nn.Embedding(T, D)
        self.ln = nn.LayerNorm(D, eps=1e-12)
        self.layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, ids):
        h = self.ln(self.emb(ids) + self.pos(torch.arange(ids.shape[1])))
        return self.head(self.layer(h).mean(1))
"""
exec(ENCODER_SOURCE)  # noqa: S102  (the same definition runs inside the 2-rank script)


class TiedLM(nn.Module):
    """A language model whose output layer is the padding embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, padding_idx=PAD)
        self.mix = nn.Linear(D, D)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids)))).reshape(-1, V)


def _batches(steps: int = 3, batch: int = 4):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, V, (steps, batch, T))
    ids[:, :, T - 2:] = PAD  # two padding tokens at the end of every sequence
    ids[:, 0, 1:] = PAD  # and one sequence that is mostly padding
    return ids, rng.integers(0, CLASSES, (steps, batch))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
    "sgd_momentum_decay": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9,
                                                     weight_decay=0.01, nesterov=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.05),
}


def _train_torch(module: nn.Module, make_opt, ids, y) -> nn.Module:
    opt = make_opt(module.parameters())
    for b in range(len(ids)):
        opt.zero_grad()
        nn.functional.cross_entropy(module(torch.from_numpy(ids[b])),
                                    torch.from_numpy(y[b])).backward()
        opt.step()
    return module


def _train_both(module: nn.Module, make_opt, steps: int = 3):
    """(module trained by ngdist, torch's float64 and float32 copies trained by torch)."""
    ids, y = _batches(steps)
    ref = _train_torch(copy.deepcopy(module).double(), make_opt, ids, y)
    ref32 = _train_torch(copy.deepcopy(module), make_opt, ids, y)
    trainer = ngdist.compile(module, torch.zeros(2, T, dtype=torch.long),
                             loss=nn.CrossEntropyLoss(), optimizer=make_opt(module.parameters()),
                             strategy="local")
    check_step_graph(trainer.step_model)
    for b in range(steps):
        trainer.step({"ids": ids[b], "y": y[b]})
    trainer.to_torch()
    return module, ref, ref32


def _assert_parameters_match(module: nn.Module, ref: nn.Module, ref32: nn.Module) -> None:
    """Every parameter within TOL of torch float64, or within 10x torch's own float32 error
    where float32 is ill-conditioned (Adam on the attention's key bias, whose gradient is zero
    in theory: its update normalises rounding noise)."""
    for (name, mine), theirs, t32 in zip(module.named_parameters(), ref.parameters(),
                                         ref32.parameters()):
        theirs = theirs.detach().numpy()
        bound = max(TOL, 10 * max_rel_err(t32.detach().numpy(), theirs))
        assert max_rel_err(mine.detach().numpy(), theirs) <= bound, (name, bound)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_zero_padding_row_stays_exactly_zero_and_parameters_match_torch(opt):
    module = Encoder()
    assert not torch.any(module.emb.weight[PAD])
    module, ref, ref32 = _train_both(module, OPTIMIZERS[opt])
    row = module.emb.weight[PAD].detach().numpy()
    assert row.tobytes() == np.zeros(D, np.float32).tobytes()
    assert not torch.any(ref.emb.weight[PAD])
    _assert_parameters_match(module, ref, ref32)


@pytest.mark.parametrize("opt", ["sgd_momentum_decay", "adamw", "adam_l2"])
def test_nonzero_padding_row_changes_only_by_weight_decay_as_in_torch(opt):
    module = Encoder()
    with torch.no_grad():
        module.emb.weight[PAD] = torch.linspace(-1.0, 1.0, D)
    start = module.emb.weight[PAD].detach().clone()
    module, ref, ref32 = _train_both(module, OPTIMIZERS[opt])
    decayed = ref.emb.weight[PAD].detach()
    assert not torch.equal(decayed.float(), start)  # weight decay moved it in torch
    assert max_rel_err(module.emb.weight[PAD].detach().numpy(), decayed.numpy()) <= 1e-6
    _assert_parameters_match(module, ref, ref32)


def test_tied_padding_row_gets_the_output_layers_gradient():
    module = TiedLM()
    ids, _ = _batches(1, batch=3)
    rng = np.random.default_rng(1)
    labels = rng.integers(0, V, ids[0].size)
    model, _ = tfront.training_model(module, torch.zeros(2, T, dtype=torch.long),
                                     loss=nn.CrossEntropyLoss(), optimizer="sgd:lr=0.01")
    got = run_step(model, {"ids": ids[0], "y": labels})
    loss, grads, _ = torch_step(module, ids[0], labels, nn.CrossEntropyLoss(), float64=True)
    assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
    assert abs(grads["emb.weight"][PAD]).max() > 1e-3  # the output layer's part
    errors = gradient_errors(got, grads)
    assert max(errors.values()) <= TOL, errors


def test_sparse_embedding_with_sgd_trains_as_torch_sparse_sgd():
    module = Encoder(sparse=True)
    momentum = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)  # noqa: E731
    module, ref, ref32 = _train_both(module, momentum)  # torch's side: sparse gradients
    assert module.emb.weight[PAD].detach().numpy().tobytes() == \
        np.zeros(D, np.float32).tobytes()
    _assert_parameters_match(module, ref, ref32)


def test_padding_embedding_that_forward_does_not_use_is_no_obstacle():
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.spare = nn.Embedding(V, D, padding_idx=PAD)
            self.fc = nn.Linear(T, CLASSES)

        def forward(self, x):
            return self.fc(x)

    trainer = ngdist.compile(Unused(), torch.zeros(2, T), loss=nn.CrossEntropyLoss(),
                             strategy="local", optimizer="sgd:lr=0.01")
    check_step_graph(trainer.step_model)


def _refusal(module: nn.Module, optimizer=None) -> str:
    with warnings.catch_warnings(), pytest.raises(GraphError) as info:
        warnings.simplefilter("ignore")
        ngdist.compile(module, torch.zeros(2, T, dtype=torch.long), loss=nn.CrossEntropyLoss(),
                       strategy="local", optimizer="sgd:lr=0.01" if optimizer is None
                       else optimizer(module.parameters()))
    return str(info.value)


REFUSALS = {
    "max_norm": (lambda: nn.Sequential(nn.Embedding(V, D, max_norm=1.0), nn.Flatten(),
                                       nn.Linear(T * D, CLASSES)), None,
                 "Embedding '0' has max_norm=1.0: torch renormalises the looked-up rows of its "
                 "weight in place during forward, which ngdist does not reproduce; drop max_norm "
                 "(or renormalise the weight yourself between steps)"),
    "scale_grad_by_freq": (
        lambda: nn.Sequential(nn.Embedding(V, D, scale_grad_by_freq=True), nn.Flatten(),
                              nn.Linear(T * D, CLASSES)), None,
        "Embedding '0' has scale_grad_by_freq=True: ngdist does not scale rows by their count "
        "in the batch (on several ranks that count would be the global batch's); use "
        "scale_grad_by_freq=False"),
    "sparse_adam": (Encoder.__new__, lambda ps: torch.optim.Adam(ps, lr=0.01),
                    "Embedding 'emb' has sparse=True and torch.optim.Adam does not support "
                    "sparse gradients (torch raises at its first step); use sparse=False "
                    "(ngdist's gradients are dense)"),
    "sparse_adamw": (Encoder.__new__, lambda ps: torch.optim.AdamW(ps, lr=0.01),
                     "Embedding 'emb' has sparse=True and torch.optim.AdamW does not support "
                     "sparse gradients (torch raises at its first step); use sparse=False "
                     "(ngdist's gradients are dense)"),
    "sparse_adagrad": (Encoder.__new__, lambda ps: torch.optim.Adagrad(ps, lr=0.01),
                       "Embedding 'emb' has sparse=True and ngdist takes sparse gradients only "
                       "with SGD without weight decay, not Adagrad; use sparse=False (ngdist's "
                       "gradients are dense)"),
    "sparse_sgd_weight_decay": (
        Encoder.__new__, lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01),
        "Embedding 'emb' has sparse=True and torch.optim.SGD with weight_decay fails on a "
        "sparse gradient (add(sparse, dense) is not supported); use sparse=False (ngdist's "
        "gradients are dense)"),
    "embedding_bag_padding": (
        lambda: nn.Sequential(nn.EmbeddingBag(V, D, padding_idx=PAD), nn.Linear(D, CLASSES)),
        None, "EmbeddingBag '0' has padding_idx=0, which ngdist does not honour; use "
              "nn.Embedding and a reduction"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_embedding_options_are_refused(case):
    make, optimizer, message = REFUSALS[case]
    module = Encoder(sparse=True) if make is Encoder.__new__ else make()
    assert _refusal(module, optimizer) == message


def test_torch_refuses_what_ngdist_says_torch_refuses_for_sparse_gradients():
    """The refusals above that name torch mirror it: its own step fails on these sparse
    gradients (Adagrad, which torch accepts, is refused in ngdist's own words)."""
    cases = [(getattr(torch.optim, name), {"lr": 0.1}, "does not support sparse gradients")
             for name in sorted(_TORCH_REFUSES_SPARSE)]
    cases.append((torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.01},
                  "add(sparse, dense) is not supported"))
    for cls, kwargs, text in cases:
        emb = nn.Embedding(V, D, sparse=True)
        opt = cls(emb.parameters(), **kwargs)
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(RuntimeError, match=re.escape(text)):
            opt.step()


RANKS_SCRIPT = """
import json
import sys
import numpy as np
import torch
import ngdist
nn = torch.nn
V, D, T, PAD, CLASSES = {consts}
{source}
module = Encoder()
trainer = ngdist.compile(module, torch.zeros(2, T, dtype=torch.long), loss=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9,
                                                   weight_decay=0.01), timeout=60)
data = np.load(sys.argv[1])
batches = [{{"ids": data[f"ids{{i}}"], "y": data[f"y{{i}}"]}} for i in range(int(data["steps"]))]
for mine in trainer.shard(batches):
    trainer.step(mine)
trainer.to_torch()
np.savez(f"params{{trainer.rank}}.npz",
         **{{n: p.detach().numpy() for n, p in module.named_parameters()}})
print("RESULT " + json.dumps({{"rank": trainer.rank, "acc": 0}}))
"""


@pytest.mark.mpi
def test_padding_on_two_ranks_equals_torch_on_the_combined_batch(ranks, tmp_path):
    """2 ranks under mpiexec, each fed its shard of global batches of 4, 6 and 4 samples:
    every rank ends with the same bytes, the padding row exactly zero, and torch's parameters
    after SGD (momentum, weight decay) on the whole batches in float64."""
    rng = np.random.default_rng(2)
    sizes = (4, 6, 4)
    data: dict[str, np.ndarray] = {"steps": np.array(len(sizes))}
    for i, n in enumerate(sizes):
        ids = rng.integers(1, V, (n, T))
        ids[:, T - 2:] = PAD
        ids[0, 2:] = PAD
        data[f"ids{i}"], data[f"y{i}"] = ids, rng.integers(0, CLASSES, n)
    np.savez(tmp_path / "batches.npz", **data)
    script = RANKS_SCRIPT.format(consts=(V, D, T, PAD, CLASSES), source=ENCODER_SOURCE)
    ranks(2, script, timeout=200, args=[str(tmp_path / "batches.npz")])
    got = [np.load(tmp_path / f"params{r}.npz") for r in range(2)]
    momentum = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=0.01)  # noqa
    ids = [data[f"ids{i}"] for i in range(len(sizes))]
    ys = [data[f"y{i}"] for i in range(len(sizes))]
    ref = _train_torch(Encoder().double(), momentum, ids, ys)
    for name, theirs in ref.named_parameters():
        assert got[0][name].tobytes() == got[1][name].tobytes(), name
        assert max_rel_err(got[0][name], theirs.detach().numpy()) <= TOL, name
    assert got[0]["emb.weight"][PAD].tobytes() == np.zeros(D, np.float32).tobytes()
