"""Ranks as separate "hosts" on one machine: network namespaces joined by a bridge.

Each rank gets its own network namespace ``<prefix><i>`` with one veth pair into a bridge in the
root namespace (address 10.77.0.254), address 10.77.0.<i+1>, and a ``tbf`` bandwidth limit on
both ends of its veth (so each "host" has a link of ``rate`` in each direction). mpiexec's
``rsh`` launcher starts each rank's hydra proxy through a wrapper that enters the namespace of
the host it was given, so MPICH sees one rank per node and talks TCP (``UCX_TLS=tcp``) through
the veths; ``veth_bytes`` reads the counters that show the traffic really went that way.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): ``available()`` says why not otherwise.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

SUBNET = "10.77.0"
BRIDGE_IP = f"{SUBNET}.254"

WRAPPER = """#!/bin/sh
# hydra's rsh launcher calls: wrapper HOST COMMAND...; HOST is 10.77.0.<i+1> -> namespace i
host="$1"; shift
exec ip netns exec "{prefix}$(( ${{host##*.}} - 1 ))" sh -c "$*"
"""


def available() -> str | None:
    """None if namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc): run the netns mode as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` tool (iproute2)"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _tbf(dev: str, rate: str, ns: str | None = None) -> None:
    _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
        "latency", "100ms", ns=ns)


@contextlib.contextmanager
def namespaces(n: int, rate: str = "1gbit", prefix: str = "ngdns") -> Iterator[list[str]]:
    """Create the namespaces; yield the mpiexec arguments that place rank i in namespace i."""
    bridge = f"{prefix}br"
    tmp = Path(tempfile.mkdtemp(prefix="ngdist-netns-"))
    wrapper = tmp / "enter_ns.sh"
    wrapper.write_text(WRAPPER.format(prefix=prefix))
    wrapper.chmod(0o755)
    made: list[str] = []
    try:
        _ip("ip", "link", "add", bridge, "type", "bridge")
        made.append(bridge)
        _ip("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", bridge)
        _ip("ip", "link", "set", bridge, "up")
        for i in range(n):
            ns, outer, inner = f"{prefix}{i}", f"{prefix}v{i}", f"{prefix}p{i}"
            _ip("ip", "netns", "add", ns)
            made.append(ns)
            _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("ip", "link", "set", inner, "netns", ns)
            _ip("ip", "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", inner, ns=ns)
            _ip("ip", "link", "set", inner, "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            _ip("ip", "route", "add", "default", "via", BRIDGE_IP, ns=ns)
            _ip("ip", "link", "set", outer, "master", bridge)
            _ip("ip", "link", "set", outer, "up")
            _tbf(outer, rate)          # bridge -> rank i
            _tbf(inner, rate, ns=ns)   # rank i -> bridge
        hosts = ",".join(f"{SUBNET}.{i + 1}" for i in range(n))
        yield ["-launcher", "rsh", "-launcher-exec", str(wrapper), "-localhost", BRIDGE_IP,
               "-hosts", hosts, "-ppn", "1"]
    finally:
        for name in reversed(made):
            cmd = ["ip", "link", "del", name] if name == bridge else ["ip", "netns", "del", name]
            subprocess.run(cmd, check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def veth_bytes(n: int, prefix: str = "ngdns") -> int:
    """Bytes that went into the namespaces through their veths (root-namespace tx counters)."""
    total = 0
    for i in range(n):
        total += int(Path(f"/sys/class/net/{prefix}v{i}/statistics/tx_bytes").read_text())
    return total
