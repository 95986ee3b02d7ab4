"""Several "hosts" on this machine, for tests of what crosses a network.

Each host is a network namespace with its own address on a bridge, and runs each process in a mount
namespace of its own whose /dev/shm is the host's (a tmpfs per host), so that processes of one host
share memory and a kv-store client on one host and a shard on another talk TCP, as across real
machines. The test process stays in the root namespace
and reaches every host through the bridge. A host can be cut off (its link down: packets vanish,
connections hang, as when a machine or its switch port dies) or throttled (a token bucket on its link).
Needs root and iproute2 (`ip`, `tc`), as CI and these machines have.
"""

from __future__ import annotations

import secrets
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SUBNET = "10.77.0"  # hosts get .1, .2, ...; the root namespace (the tests) .254
SHM_BYTES = 1 << 30  # each host's /dev/shm (a limit, not a reservation)


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


class Hosts:
    """`with Hosts(["a", "b"]) as hosts:` the hosts, torn down on exit (namespaces, links, bridge)."""

    def __init__(self, names: Sequence[str]):
        tag = secrets.token_hex(2)
        self.bridge = f"llbr{tag}"
        self._netns = {name: f"llmesh-{tag}-{name}" for name in names}
        self._veth = {name: f"ll{tag}{i}" for i, name in enumerate(names)}  # the root side of each host's link
        self._address = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self._shm: dict[str, Path] = {}  # each host's /dev/shm

    def __enter__(self) -> Hosts:
        try:
            for name in self._netns:
                self._shm[name] = Path(tempfile.mkdtemp(prefix=f"llmesh-shm-{name}-"))
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={SHM_BYTES}", "tmpfs", str(self._shm[name])],
                    check=True,
                    capture_output=True,
                )
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{SUBNET}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name, netns in self._netns.items():
                _ip("netns", "add", netns)
                _ip("link", "add", self._veth[name], "type", "veth", "peer", "name", "eth0", "netns", netns)
                _ip("link", "set", self._veth[name], "master", self.bridge, "up")
                _ip("addr", "add", f"{self._address[name]}/24", "dev", "eth0", netns=netns)
                _ip("link", "set", "eth0", "up", netns=netns)
                _ip("link", "set", "lo", "up", netns=netns)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for netns in self._netns.values():
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True)  # its veth pair goes with it
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        for shm in self._shm.values():
            subprocess.run(["umount", "--lazy", str(shm)], capture_output=True)
            shm.rmdir()

    def address(self, name: str) -> str:
        return self._address[name]

    def prefix(self, name: str, tmpfs: dict[str, int] | None = None) -> list[str]:
        """What runs a command on host `name`: in its network namespace, with the host's /dev/shm and
        each `tmpfs` directory (path -> bytes) a filesystem that size of its own (a full disk gives a
        real ENOSPC)."""
        steps = [f"mount --bind {shlex.quote(str(self._shm[name]))} /dev/shm"]
        steps += [
            f"mkdir -p {shlex.quote(path)} && mount -t tmpfs -o size={size} tmpfs {shlex.quote(path)}"
            for path, size in (tmpfs or {}).items()
        ]
        return [
            "ip",
            "netns",
            "exec",
            self._netns[name],
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{" && ".join(steps)} && exec "$@"',
            "sh",
        ]

    def cut(self, name: str) -> None:
        """Host `name` drops off the network: its link goes down, nothing it sends or is sent arrives."""
        _ip("link", "set", self._veth[name], "down")

    def throttle(self, name: str, rate: str | None) -> None:
        """Host `name`'s link carries at most `rate` (tc's token bucket, e.g. "64kbit") each way, its
        queue holding at most 400 ms of packets (the rest are dropped and TCP sends them again): a
        congested or failing link. None: as before. (This kernel has no netem for plain delay.)"""
        for netns, dev in ((None, self._veth[name]), (self._netns[name], "eth0")):
            command = (
                [
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "16kbit",
                    "latency",
                    "400ms",
                ]
                if rate
                else ["tc", "qdisc", "del", "dev", dev, "root"]
            )
            subprocess.run(
                ["ip", "netns", "exec", netns, *command] if netns else command, check=True, capture_output=True
            )
