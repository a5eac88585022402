"""Where a P/D row's two engines run: both on this host's loopback (the default), or P and D on two
"hosts" (``netns.two_hosts(management=True)``), each engine in its namespace, its KV and control
traffic on the hosts' own link (``Side.address``) and this process reaching its HTTP port over the
management link (``Side.reach``). The rows of ``run.py`` and ``peers.py`` build their engines and
addresses from a ``Place``; ``link.py`` hands them the two hosts'.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .options import engine
from aiolayer.harness.procs import free_port


@dataclasses.dataclass(frozen=True)
class Side:
    address: str = "127.0.0.1"     # where the other engine (and its KV) reaches this one
    reach: str = "127.0.0.1"       # where this process reaches its HTTP port
    netns: str | None = None       # the namespace it runs in; None: this one
    dev: str | None = None         # its end of the link between the hosts (None on loopback)

    def engine(self, model: Path, name: str, core: str, args: argparse.Namespace, *, env: dict, **kw):
        """The row's engine on this side: in its namespace, serving on every address there (the link
        for the other side, the management link for this process), its connector on ``address``."""
        if self.netns is None:
            return engine(model, name, core, args, env=env, **kw)
        return engine(model, name, core, args, env={**env, "VLLM_HOST_IP": self.address}, netns=self.netns,
                      host=self.reach, bind_host="0.0.0.0", port=free_port(), **kw)


@dataclasses.dataclass(frozen=True)
class Place:
    p: Side = Side()
    d: Side = Side()
    label: str = "127.0.0.1"

    @property
    def two_hosts(self) -> bool:
        return self.p.netns is not None


LOOPBACK = Place()


def of_hosts(hosts) -> Place:
    """P on host A, D on host B of ``netns.two_hosts(management=True)``."""
    a, b = hosts.a, hosts.b
    return Place(Side(a.address, a.mgmt, a.ns, a.dev), Side(b.address, b.mgmt, b.ns, b.dev),
                 label=f"veth {a.address} -> {b.address}")


def of_args(args: argparse.Namespace) -> Place:
    return getattr(args, "place", None) or LOOPBACK
