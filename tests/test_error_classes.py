"""Every deliberate error derives from NgdistError: the ``raise`` sites of ngdist/ (ast) that
raise a Python builtin exception are listed here, each with why it is not an NgdistError; a new
one fails this test until it raises a class of ngdist/errors.py (ArgumentError and
ArgumentTypeError are ValueError and TypeError too) or is listed with its reason. Also the
mistakes a new user makes first: a misspelt loss, labels named like a model output."""
from __future__ import annotations

import ast
import builtins
from collections import Counter
from pathlib import Path

import pytest

import ngdist
from ngdist import errors, zoo
from ngdist.errors import GraphError, NgdistError, OptionError
from ngdist.ir.model import save_proto

ROOT = Path(__file__).resolve().parents[1] / "ngdist"
BUILTIN = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
           and issubclass(getattr(builtins, n), BaseException)}
# (path under ngdist/ or a folder ending in /, exception) -> why it stays a builtin
ALLOWED = {
    ("passes/autodiff/rules/", "ValueError"): "the autodiff driver wraps every rule's failure "
                                              "in a GradientError naming the node",
    ("frontends/torch_attention.py", "ValueError"): "raised inside torch.onnx.export, whose "
                                                    "failure the frontend reports as GraphError",
    ("optim/spec.py", "ValueError"): "caught in the same function, re-raised as OptionError",
    ("comm/__init__.py", "SystemExit"): "ends a rank whose peer failed (comm/exits.py)",
    ("launcher.py", "KeyboardInterrupt"): "re-raises the user's Ctrl-C",
    ("optim/base.py", "NotImplementedError"): "an abstract method",
    ("comm/shared.py", "OSError"): "caught by its caller, which falls back to MPI",
    ("ir/atomic.py", "NotADirectoryError"): "the OS's own error for a path that is a file",
    ("kernels/collectives.py", "ValueError"): "a kernel's check of what a pass built",
    ("runtime/state.py", "KeyError"): "load_state_dict's KeyError, which callers catch",
    ("zoo_sweep.py", "RuntimeError"): "the model sweep benchmark, outside the training API",
    ("zoo_vision.py", "OSError"): "the model catalogue, outside the training API",
    ("zoo_vision.py", "ValueError"): "the model catalogue, outside the training API",
    ("zoo_transformers.py", "ValueError"): "the model catalogue, outside the training API",
}
# a missing optional package is an ImportError, as Python's own import says
ANYWHERE = {"ImportError"}


def builtin_raises() -> Counter:
    """(path under ngdist/, exception name) -> how many raise sites."""
    found: Counter = Counter()
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = getattr(exc, "id", None)
            if name in BUILTIN and name not in ANYWHERE:
                found[(path.relative_to(ROOT).as_posix(), name)] += 1
    return found


def _allowed(path: str, name: str) -> bool:
    return any(n == name and (path == p or (p.endswith("/") and path.startswith(p)))
               for p, n in ALLOWED)


def test_every_deliberate_error_is_an_ngdist_error():
    unexplained = sorted(f"ngdist/{p}: raise {n} ({k}x)" for (p, n), k in builtin_raises().items()
                         if not _allowed(p, n))
    assert not unexplained, "raise a class of ngdist/errors.py instead:\n" + "\n".join(
        unexplained)


def test_the_allowed_list_has_no_stale_entries():
    found = builtin_raises()
    stale = [key for key in ALLOWED if not any(
        n == key[1] and (p == key[0] or (key[0].endswith("/") and p.startswith(key[0])))
        for p, n in found)]
    assert not stale


def test_the_error_classes_derive_from_ngdist_error():
    classes = [c for c in vars(errors).values() if isinstance(c, type)
               and issubclass(c, Exception) and c.__module__ == errors.__name__]
    assert {c.__name__ for c in classes} >= {"ArgumentError", "ArgumentTypeError"}
    assert all(issubclass(c, NgdistError) for c in classes)
    assert issubclass(errors.ArgumentError, ValueError)
    assert issubclass(errors.ArgumentTypeError, TypeError)


def test_a_public_type_mistake_is_an_ngdist_error():
    with pytest.raises(errors.ArgumentTypeError, match="takes a number or a numpy array"):
        ngdist.allreduce_mean("1.0")


def test_an_unknown_loss_string_gets_the_closest_name():
    with pytest.raises(OptionError, match=r"unknown loss 'mean_square_error'; did you mean "
                                          r"'mean_squared_error'\?"):
        ngdist.to_training_model(zoo.mlp((4, 3)), loss="mean_square_error",
                                 optimizer=ngdist.optim.SGD(lr=0.1))


def test_labels_named_like_the_model_output_are_refused():
    model = zoo.mlp((4, 3))
    model.graph.output[0].name = "y"
    model.graph.node[-1].output[0] = "y"
    with pytest.raises(GraphError, match=r"the labels input 'y' has the name of a model output "
                                         r"\('y'\); pass labels= another name \(ngdist "
                                         r"rewrite/train: --labels\)"):
        ngdist.to_training_model(model, optimizer=ngdist.optim.SGD(lr=0.1))


def test_compile_without_an_optimizer_is_refused_unless_the_model_holds_its_step(tmp_path):
    hint = ("has no training step and no optimizer was given: pass optimizer= (e.g. "
            "optimizer=ngdist.optim.SGD(lr=0.01) or a spec like 'adamw:lr=1e-3')")
    with pytest.raises(OptionError) as info:
        ngdist.compile(zoo.mlp((4, 3)), strategy="local")
    assert str(info.value) == f"the ONNX model {hint}"
    save_proto(zoo.mlp((4, 3)), tmp_path / "mlp.onnx")
    with pytest.raises(OptionError) as info:
        ngdist.compile(tmp_path / "mlp.onnx", strategy="local", optimizer=None)
    assert str(info.value) == f"{tmp_path / 'mlp.onnx'} {hint}"
    # a training model holds its optimizer: it compiles without one
    trained = ngdist.to_training_model(zoo.mlp((4, 3)), optimizer=ngdist.optim.SGD(lr=0.1))
    assert ngdist.compile(trained, strategy="local").step_model is not None
