"""Two "hosts" on one machine: two network namespaces joined by a veth pair, nothing else between them.

``two_hosts()`` creates them (each with its own address on the veth and its own loopback), yields a
``Hosts`` that starts processes inside either one, shapes or cuts the link, and deletes everything on
exit, also on failure: the processes it started are killed, the namespaces (and with them the veth
pair) deleted. Needs root and ``ip``/``tc`` (iproute2); ``available()`` says why not otherwise.
A process in one namespace can reach the other only through the veth: a leaked 127.0.0.1 dials its
own namespace's loopback and fails. Installed as ``aiolayer.harness.netns``: the bench's network fault
rows and ``--two-hosts`` use it, and so do tests/backends/test_two_hosts*.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field

CMD_TIMEOUT_S = 10


def _ip(*argv: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def available() -> str:
    """'' when namespaces can be made here; else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    probe = f"aiol-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add failed: {exc}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT_S)
    return ""


@dataclass
class Host:
    ns: str
    dev: str
    address: str       # on the link between the two hosts
    mgmt: str = ""     # on this host's management link to the test process (``two_hosts(management=True)``)


@dataclass
class Hosts:
    a: Host
    b: Host
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, host: Host, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, in its own process group (killed at exit)."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.ns, *argv], timeout=timeout, **kw)

    def shape(self, gbit: float | None) -> None:
        """Give the link a rate (tbf on both ends); None removes it."""
        for host in (self.a, self.b):
            subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "del", "dev", host.dev, "root"],
                           capture_output=True, timeout=CMD_TIMEOUT_S)
            if gbit is not None:   # a burst of ~10 ms of traffic: a bigger one passes slow links at full speed
                burst = max(16 * 1024, int(gbit * 1e9 / 8 / 100))
                _ip("tc", "qdisc", "add", "dev", host.dev, "root", "tbf", "rate", f"{max(8, int(gbit * 1e6))}kbit",
                    "burst", str(burst), "latency", "50ms", ns=host.ns)

    def link(self, up: bool) -> None:
        """Cut (partition) or restore the link, on both ends."""
        for host in (self.a, self.b):
            _ip("ip", "link", "set", "dev", host.dev, "up" if up else "down", ns=host.ns)

    def readdress(self, host: Host, address: str) -> None:
        """Give ``host`` a new address (the old one is gone): a restarted machine that moved."""
        _ip("ip", "addr", "flush", "dev", host.dev, ns=host.ns)
        _ip("ip", "addr", "add", f"{address}/24", "dev", host.dev, ns=host.ns)
        host.address = address

    def stop_all(self) -> None:
        """SIGTERM every process, then SIGKILL those still there after 10 s; one that outlives even that
        (unkillable, in D state) is left, so that the namespaces are deleted all the same."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)


def _management_link(host: Host, outer: str, inner: str, prefix: str) -> None:
    """A veth from the test's namespace (``prefix``.1) into ``host`` (``prefix``.2); it goes with the namespace."""
    _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
    _ip("ip", "link", "set", inner, "netns", host.ns)
    _ip("ip", "addr", "add", f"{prefix}.1/24", "dev", outer)
    _ip("ip", "link", "set", outer, "up")
    _ip("ip", "addr", "add", f"{prefix}.2/24", "dev", inner, ns=host.ns)
    _ip("ip", "link", "set", inner, "up", ns=host.ns)
    host.mgmt = f"{prefix}.2"


@contextlib.contextmanager
def two_hosts(subnet: int | None = None, management: bool = False):
    """Namespaces A (10.S.0.1) and B (10.S.0.2) joined by a veth pair; deleted on exit.

    ``management``: each also gets a link to the test's own namespace (A: 10.S.1.2, B: 10.S.2.2), the
    way a client reaches a proxy and a test reaches each server's /health. Neither namespace has a
    route to the other's management subnet, so A and B still meet only on their own link."""
    tag = uuid.uuid4().hex[:6]
    octet = subnet if subnet is not None else 100 + int(tag, 16) % 100
    a = Host(f"aiol-{tag}-a", f"va{tag}", f"10.{octet}.0.1")
    b = Host(f"aiol-{tag}-b", f"vb{tag}", f"10.{octet}.0.2")
    hosts = Hosts(a, b)
    try:
        for host in (a, b):
            _ip("ip", "netns", "add", host.ns)
            _ip("ip", "link", "set", "lo", "up", ns=host.ns)
        _ip("ip", "link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for host in (a, b):
            _ip("ip", "link", "set", host.dev, "netns", host.ns)
            _ip("ip", "addr", "add", f"{host.address}/24", "dev", host.dev, ns=host.ns)
            _ip("ip", "link", "set", host.dev, "up", ns=host.ns)
        if management:
            for index, host in ((1, a), (2, b)):
                _management_link(host, f"m{index}{tag}", f"n{index}{tag}", f"10.{octet}.{index}")
        yield hosts
    finally:
        try:
            hosts.stop_all()
        finally:   # a second Ctrl-C while the processes stop still deletes the namespaces
            for host in (a, b):   # deleting a namespace deletes its end of the veth, and so the pair
                subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=CMD_TIMEOUT_S)
        for dev in (a.dev, f"m1{tag}", f"m2{tag}"):   # gone with the namespaces unless creation failed half-way
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=CMD_TIMEOUT_S)
