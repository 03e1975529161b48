"""The zoo tier (hooks imported by tests/conftest.py; a conftest.py of its own under tests/zoo
would shadow the top-level one, whose helpers tests import as ``conftest``): ``test_model`` of every case of the sweep's catalogue is marked ``zoo`` and
runs only when selected (``pytest -m zoo tests/zoo``); the catalogue is enumerated only then
(timm's families alone take minutes). Without ``-m zoo`` the ``CI_MODELS`` subset runs."""
from __future__ import annotations

import pytest


def zoo_selected(config: pytest.Config) -> bool:
    return "zoo" in (config.option.markexpr or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if zoo_selected(config):
        return
    keep = [i for i in items if i.get_closest_marker("zoo") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``test_model`` over the whole catalogue when the zoo tier is selected, else over one
    placeholder that the collection hook above deselects."""
    if metafunc.function.__name__ != "test_model":
        return
    cases = [("not-selected", "")]
    if zoo_selected(metafunc.config):
        import model_sweep  # benchmarks/, put on sys.path by test_sweep.py

        cases = [(c.name, c.family) for c in model_sweep.catalogue(all_constructors=False)]
    metafunc.parametrize("name,family", cases, ids=[n for n, _ in cases])
