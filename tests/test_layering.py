"""Layers only import downward (frontends -> passes -> runtime -> kernels -> comm).

Every module under ngdist/ is parsed with ``ast`` (nothing is imported), and every import it
makes, at module level or inside a function, is resolved to a module name.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ngdist"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports (``from a import b`` gives ``a`` and ``a.b``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from ..y import z
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _modules(under: str) -> dict[str, set[str]]:
    root = PACKAGE / under if under else PACKAGE
    return {_module_name(p): _imports(p) for p in sorted(root.rglob("*.py"))}


def _offenders(under: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for module, imports in _modules(under).items():
        bad = sorted(i for i in imports if any(i == f or i.startswith(f + ".")
                                               for f in forbidden))
        if bad:
            out[module] = bad
    return out


def test_the_import_parser_sees_what_a_module_imports(tmp_path):
    # the oracle: an import the rule forbids, written every way Python allows, is found
    assert "ngdist.api" in _imports(PACKAGE / "__init__.py")
    assert {"ngdist.runtime.trainer", "ngdist.comm"} <= _imports(PACKAGE / "api.py")
    assert "ngdist.ir.writeback" in _imports(PACKAGE / "frontends" / "torch.py")
    assert _modules("frontends"), "no frontend module found"


def test_frontends_never_import_the_api_the_trainer_or_compat():
    assert _offenders("frontends", ("ngdist.api", "ngdist.runtime.trainer",
                                    "ngdist.compat")) == {}


def test_frontends_hand_back_a_write_back_defined_below_the_runtime():
    # the type the trainer and the frontends share lives in the lowest layer (ngdist.ir)
    assert _offenders("ir", ("ngdist.frontends", "ngdist.passes", "ngdist.runtime",
                             "ngdist.api", "ngdist.compat")) == {}
    assert "ngdist.ir.writeback" in _imports(PACKAGE / "runtime" / "trainer.py")
    for frontend in ("torch", "keras"):
        assert "ngdist.ir.writeback" in _imports(PACKAGE / "frontends" / f"{frontend}.py")


def test_runtime_imports_no_pass_frontend_or_api():
    # roles and facts the runtime needs ride in the step graph's metadata (ngdist.ir)
    assert _offenders("runtime", ("ngdist.passes", "ngdist.frontends", "ngdist.api",
                                  "ngdist.compat", "ngdist.cli")) == {}


def test_kernels_import_no_runtime_and_nothing_above():
    assert _offenders("kernels", ("ngdist.runtime", "ngdist.passes", "ngdist.frontends",
                                  "ngdist.api", "ngdist.compat", "ngdist.cli")) == {}


def test_comm_imports_nothing_above_it():
    assert _offenders("comm", ("ngdist.kernels", "ngdist.runtime", "ngdist.passes",
                               "ngdist.frontends", "ngdist.api", "ngdist.compat",
                               "ngdist.cli", "ngdist.ir")) == {}


def test_passes_import_no_runtime_and_nothing_above():
    assert _offenders("passes", ("ngdist.runtime", "ngdist.kernels", "ngdist.comm",
                                 "ngdist.frontends", "ngdist.api", "ngdist.compat",
                                 "ngdist.cli")) == {}


def test_mpi4py_only_under_comm():
    outside = {m: i for m, i in _offenders("", ("mpi4py",)).items()
               if not m.startswith("ngdist.comm")}
    assert outside == {}
    assert "mpi4py" in _imports(PACKAGE / "comm" / "mpi.py")  # the oracle sees it there


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module in the graph of imports between
    ngdist's modules (the bare package ``ngdist``, a namespace, is left out)."""
    modules = _modules("")
    edges = {m: {i for i in imports if i in modules and i != "ngdist" and i != m}
             for m, imports in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    assert _cycles() == []
