"""The model-file fuzzer on a small seeded budget: no mutation of a real model file makes
ngdist's entry points raise a traceback, crash, hang or run out of memory."""
from __future__ import annotations

import modelfuzz
import pytest


@pytest.mark.timeout(240)
def test_fuzz_model_files(tmp_path):
    report = modelfuzz.fuzz(100, seed=20261123, folder=tmp_path, timeout=60,
                            memory_bytes=4 << 30, light=True)
    assert sum(report.counts.values()) == 100
    assert set(report.by_kind) == set(modelfuzz.MUTATIONS)  # every kind ran
    # the oracle sees both outcomes: the seed files run, the mutations are refused
    assert report.counts["ok"] > 0 and report.counts["clean"] > 0
    assert not report.failures, "\n" + report.table() + "\n" + "\n".join(
        report.failure_lines())


def test_classifier_sees_each_bad_outcome(tmp_path):
    """The runner's oracle: a traceback, a crash (signal), a hang and an out-of-memory of a
    worker are each reported as such, not as a clean error."""
    case = modelfuzz.Case(0, "probe", "none", str(tmp_path / "m.onnx"), False)
    worker = modelfuzz.Worker(memory_bytes=1 << 30, timeout=5)
    try:
        for env, expected in ((("NGDIST_FUZZ_PROBE", "raise"), "traceback"),
                              (("NGDIST_FUZZ_PROBE", "segv"), "crash"),
                              (("NGDIST_FUZZ_PROBE", "sleep"), "hang"),
                              (("NGDIST_FUZZ_PROBE", "alloc"), "oom")):
            case.env = dict([env])
            assert worker.run(case)[0] == expected, env
    finally:
        worker.stop()
