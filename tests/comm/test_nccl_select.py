"""Choosing the group of device buffers (comm/nccl.py ``device_group``): ``comm="host"`` keeps
the host group (kernels stage device buffers through it), ``comm="nccl"`` makes an NcclGroup,
or, where cupy or its NCCL is missing (here, CI), keeps the host group and says why."""
from __future__ import annotations

import logging

import pytest

from ngdist.comm.local import LocalGroup
from ngdist.comm import nccl
from ngdist.errors import CommError


class TwoRanks(LocalGroup):
    size = 2


def test_host_keeps_the_host_group():
    host = TwoRanks(5)
    assert nccl.device_group(host, "host", 0) is host


def test_one_rank_needs_no_nccl():
    host = LocalGroup(5)
    assert nccl.device_group(host, "nccl", 0) is host


def test_unknown_comm_is_refused():
    with pytest.raises(CommError) as info:
        nccl.device_group(TwoRanks(5), "gloo", 0)
    assert str(info.value) == "comm='gloo': choose 'host' (staged through host memory) or 'nccl'"


def test_nccl_without_cupy_falls_back_to_the_host_group(monkeypatch, caplog):
    def missing():
        raise CommError("comm='nccl' needs cupy with NCCL: pip install 'ngdist[gpu]' "
                        "(cupy-cuda13x; NCCL from nvidia-nccl-cu13) (No module named 'cupy')")
    monkeypatch.setattr(nccl, "nccl_modules", missing)
    host = TwoRanks(5)
    with caplog.at_level(logging.WARNING, logger="ngdist.comm.nccl"):
        assert nccl.device_group(host, "nccl", 0) is host
    assert caplog.messages == [
        "comm='nccl' needs cupy with NCCL: pip install 'ngdist[gpu]' (cupy-cuda13x; NCCL from "
        "nvidia-nccl-cu13) (No module named 'cupy'); communicating through host memory instead"]


def test_the_missing_cupy_is_named():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(CommError, match=r"^comm='nccl' needs cupy with NCCL: pip install "
                                            r"'ngdist\[gpu\]' \(cupy-cuda13x; NCCL from "
                                            r"nvidia-nccl-cu13\) \(No module named 'cupy'\)$"):
            nccl.nccl_modules()
    else:
        assert nccl.nccl_modules()[1] is not None
