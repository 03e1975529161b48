"""The runtime's layers stay readable: no module of ngdist/runtime, ngdist/kernels or ngdist/comm
holds 400 lines or more, and no function there is longer than 60 lines (signature and
docstring included)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ngdist"
LAYERS = ("runtime", "kernels", "comm")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (PACKAGE / layer).glob("*.py"))


def test_the_layers_have_modules():
    assert len(_modules()) > 40


@pytest.mark.parametrize("path", _modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_module_and_function_sizes(path):
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines < MAX_MODULE_LINES, f"{path.name}: {lines} lines; split it by concern"
    long = [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"
