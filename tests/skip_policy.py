"""pytest plugin: with ``--strict-skips`` (``.ci/run``), a skipped or xfailed test whose reason
is not on the allow-list fails the run. Allowed: a missing GPU, and a case that needs root or
that root cannot test. Anything else (a missing extra, a probe that found nothing, a service
that did not start) could hide a broken install, so CI must not pass with it.

Loaded by tests/conftest.py; ``python -m pytest -p skip_policy`` loads it elsewhere."""
from __future__ import annotations

import re

import pytest

ALLOWED = (
    re.compile(r"\bGPU\b"),                          # needs a GPU / one is here
    re.compile(r"\bneeds? root\b"),                  # root-only: the case needs root
    re.compile(r"^root \w+"),                        # root-only: root cannot test it
)
_KEY = pytest.StashKey[list]()


def skip_allowed(reason: str) -> bool:
    return any(p.search(reason) for p in ALLOWED)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--strict-skips", action="store_true",
                     help="fail the run on a skip or xfail whose reason is not a missing GPU "
                          "or a root-only case (tests/skip_policy.py)")


_configs: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KEY] = []
    _configs.append(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    _configs.remove(config)


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _record(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (report.skipped or hasattr(report, "wasxfail")) or not _configs:
        return
    config, reason = _configs[-1], _reason(report)
    if config.getoption("--strict-skips") and \
            (hasattr(report, "wasxfail") or not skip_allowed(reason)):
        config.stash[_KEY].append((report.nodeid, reason))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.stash.get(_KEY, []) and exitstatus in (pytest.ExitCode.OK,
                                                             pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    bad = config.stash.get(_KEY, [])
    if bad:
        terminalreporter.section("skips not allowed (--strict-skips)", red=True)
        for nodeid, reason in bad:
            terminalreporter.write_line(f"{nodeid}: {reason}")
        terminalreporter.write_line(f"{len(bad)} skipped or xfailed for a reason other than a "
                                    f"missing GPU or a root-only case: the run fails")
