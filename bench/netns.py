"""Two "hosts" on one machine for the benchmarks: this network namespace and a fresh one, joined
by a veth pair, so traffic crosses a real network stack instead of loopback (needs root and
iproute2's `ip`). A process enters the far side with enter()."""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Veth:
    namespace: str     # the far side's namespace
    near: str          # this side's address
    far: str           # the far side's address
    near_dev: str
    far_dev: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def veth_pair() -> Iterator[Veth]:
    """A namespace with one end of a veth pair (10.98.0.2), the other end here (10.98.0.1);
    removed on exit."""
    tag = os.getpid() % 100000
    pair = Veth(f"hpbench{tag}", "10.98.0.1", "10.98.0.2", f"hpbn{tag}", f"hpbf{tag}")
    try:
        _ip("netns", "add", pair.namespace)
        _ip("link", "add", pair.near_dev, "type", "veth", "peer", "name", pair.far_dev)
        _ip("link", "set", pair.far_dev, "netns", pair.namespace)
        _ip("addr", "add", f"{pair.near}/24", "dev", pair.near_dev)
        _ip("link", "set", pair.near_dev, "up")
        _ip("-n", pair.namespace, "addr", "add", f"{pair.far}/24", "dev", pair.far_dev)
        _ip("-n", pair.namespace, "link", "set", pair.far_dev, "up")
        _ip("-n", pair.namespace, "link", "set", "lo", "up")
        yield pair
    finally:
        subprocess.run(["ip", "link", "del", pair.near_dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", pair.namespace], capture_output=True)


def enter(namespace: str) -> None:
    """Moves this process (before it opens any socket or starts threads) into the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)
