"""``aiolayer doctor``'s checks of what two sides told it (``doctor`` runs them, ``doctor_transfer``
asks the sides): each returns one ``Check``, OK, FAIL (with how to fix it) or SKIP (with why). No I/O.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

from .transport import WILDCARDS

PASS, FAIL, SKIP = "OK", "FAIL", "SKIP"
# A connector's check of its config (``kv_connector_extra_config``), registered by the connector's
# distribution under this entry-point group: None when valid, else (what is wrong, how to fix it). No I/O.
CONFIG_CHECK_GROUP = "aiolayer.config_checks"
# (the extra config, the kv_transfer_config holding it or None) -> None when valid, else (what, fix)
ConfigChecker = Callable[[dict[str, Any] | None, dict[str, Any] | None], tuple[str, str] | None]
LAYOUT_FIELDS = ("num_layers", "head_bytes", "kv_layout", "kv_interior")
# blocks are copied byte for byte only between one interior; blocks of other sizes copy token by token
# where both publish one the runtime knows (protocol.plan.HeadGeometry: "" a row per token, "opaque-<kernel>" unknown)


@dataclass
class Check:
    name: str
    result: str          # PASS, FAIL or SKIP
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.result:<4}  {self.name:<18} {self.detail}"
        return text + (f"\n      fix: {self.fix}" if self.result == FAIL and self.fix else "")


@dataclass
class Side:
    label: str                      # "P" or "D"
    endpoint: str = ""
    config: dict[str, Any] | None = None
    outer: dict[str, Any] | None = None   # the kv_transfer_config holding ``config``, when the file was one
    topology: Any = None            # its TopologyReply once it answered
    rtt_ms: float = 0.0
    error: str = ""                 # why it did not answer (unreachable, refused)
    protocol_error: str = ""        # it answered in another protocol version

    @property
    def host(self) -> str:
        return host_of(self.endpoint)


def host_of(endpoint: str) -> str:
    """The host of ``tcp://host:port`` (brackets of IPv6 removed); "" if it is not one."""
    rest = endpoint.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else ""


def is_local(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback or host in WILDCARDS
    except ValueError:
        return False


def load_config(path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The extra config in ``path`` (the object itself, or the ``kv_connector_extra_config`` it holds),
    and the ``kv_transfer_config`` holding it (None when the file is the extra config itself): its
    ``kv_port``, ``kv_ip`` and ``engine_id`` stand in for the extra config's keys, as vLLM reads them."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON object expected, got {type(data).__name__}")
    inner = data.get("kv_connector_extra_config")
    return (inner, data) if isinstance(inner, dict) else (data, None)


def config_checkers() -> dict[str, ConfigChecker | BaseException]:
    """Every connector's config check (entry points ``aiolayer.config_checks``), loaded; one that fails
    to load is kept as its error. The core names no connector: each registers its own."""
    found: dict[str, ConfigChecker | BaseException] = {}
    for point in entry_points(group=CONFIG_CHECK_GROUP):
        try:
            found[point.name] = point.load()
        except Exception as exc:  # noqa: BLE001 - reported as a SKIP; the other checks still run
            found[point.name] = exc
    return found


def check_config(side: Side) -> Check:
    """The connector's own validation (the vLLM bridge's: ``aiolayer_vllm.config``): an unknown key or a
    bad value, named."""
    name = f"config {side.label}"
    checkers = config_checkers()
    if not checkers:
        return Check(name, SKIP, "no connector installed here checks its config (the vLLM bridge, "
                                 "aiolayer-vllm, does)")
    for connector, checker in sorted(checkers.items()):
        if isinstance(checker, BaseException):
            return Check(name, SKIP, f"the {connector} connector's config check does not load: {checker}")
        failure = checker(side.config, side.outer)
        if failure is not None:
            what, fix = failure
            return Check(name, FAIL, what, fix)
    return Check(name, PASS, "kv_connector_extra_config is valid")


def endpoint_from_config(config: dict[str, Any], outer: dict[str, Any] | None = None) -> str:
    """``tcp://advertise_host:control_port`` as the config says, vLLM's ``kv_ip`` and ``kv_port`` standing
    in for an absent ``bind_host`` and ``control_port`` ("" when it does not say enough)."""
    given = config.get("transport")
    transport: dict[str, Any] = given if isinstance(given, dict) else {}
    vllm: dict[str, Any] = outer if isinstance(outer, dict) else {}   # not objects: the config check says why
    host = transport.get("advertise_host") or transport.get("bind_host") or vllm.get("kv_ip") or "127.0.0.1"
    port = config.get("control_port") or vllm.get("kv_port") or 0
    if not port or not isinstance(host, str) or host in WILDCARDS:
        return ""
    return f"tcp://[{host}]:{port}" if ":" in str(host) else f"tcp://{host}:{port}"


def check_reach(side: Side, timeout: float) -> Check:
    name = f"reach {side.label}"
    if not side.endpoint:
        return Check(name, FAIL, "no control endpoint: neither given nor known from its config",
                     f"pass --{side.label.lower()}-control tcp://HOST:PORT, or set control_port (not 0) and "
                     "transport.advertise_host in its config")
    if side.topology is not None:
        return Check(name, PASS, f"{side.endpoint} answered in {side.rtt_ms:.1f} ms "
                     f"(engine {side.topology.engine_id!r})")
    if side.protocol_error:
        return Check(name, PASS, f"{side.endpoint} answers, in another protocol (see protocol)")
    return Check(name, FAIL, f"{side.endpoint}: {side.error}",
                 f"check the port (P: control_port of its config; a D node: the \"control\" of its JSON line), "
                 f"that the engine runs, that it binds an address this host reaches (bind_host 127.0.0.1 is "
                 f"reachable from its own host only), and firewalls; the call waited at most {timeout:g} s")


def check_protocol(p: Side, d: Side) -> Check:
    from .protocol.messages import PROTOCOL_VERSION

    bad = [s for s in (p, d) if s.protocol_error]
    if bad:
        return Check("protocol", FAIL, "; ".join(f"{s.label}: {s.protocol_error}" for s in bad),
                     f"install the same aiolayer on both hosts (this doctor speaks protocol {PROTOCOL_VERSION})")
    if p.topology is None or d.topology is None:
        return Check("protocol", SKIP, "a side did not answer")
    return Check("protocol", PASS, f"protocol {PROTOCOL_VERSION} on both")


def check_version(p: Side, d: Side) -> Check:
    from .version import __version__

    if p.topology is None or d.topology is None:
        return Check("version", SKIP, "a side did not answer")
    pv, dv = p.topology.version or "older than 0.1.0", d.topology.version or "older than 0.1.0"
    if pv != dv:
        return Check("version", FAIL, f"P runs aiolayer {pv}, D runs {dv}",
                     "install the same aiolayer version on both hosts (pip install aiolayer==X on each)")
    note = "" if pv == __version__ else f" (this doctor is {__version__})"
    return Check("version", PASS, f"aiolayer {pv} on both{note}")


def check_layout(p: Side, d: Side) -> Check:
    if p.topology is None or d.topology is None:
        return Check("layout", SKIP, "a side did not answer")
    pt, dt = p.topology, d.topology
    missing = [s.label for s, t in ((p, pt), (d, dt)) if not t.block_bytes]
    if missing:
        return Check("layout", FAIL, f"{' and '.join(missing)} registered no KV layout yet",
                     "wait until the engine has loaded its model (its KV cache is registered then), and ask again")
    diffs = [f"{f}: P {getattr(pt, f)!r}, D {getattr(dt, f)!r}" for f in LAYOUT_FIELDS
             if getattr(pt, f) != getattr(dt, f)]
    if pt.kv_heads * pt.tp_size != dt.kv_heads * dt.tp_size:
        diffs.append(f"KV heads (per rank x TP): P {pt.kv_heads} x {pt.tp_size}, D {dt.kv_heads} x {dt.tp_size}")
    if pt.model and dt.model and pt.model != dt.model:
        diffs.append(f"model: P {pt.model!r}, D {dt.model!r}")
    if pt.block_size != dt.block_size and (pt.kv_interior != dt.kv_interior or pt.kv_interior.startswith("opaque")):
        diffs.append(f"block_size: P {pt.block_size!r}, D {dt.block_size!r}, and blocks whose interiors "
                     f"({pt.kv_interior!r:.40}, {dt.kv_interior!r:.40}) do not copy token by token")
    if diffs:
        return Check("layout", FAIL, "; ".join(diffs),
                     "run the same model on both with the same KV cache dtype and KV layout (the same block "
                     "size where the kernels differ); TP sizes and block sizes may differ, the model's KV heads "
                     "may not")
    sizes = f"{pt.block_size}" if pt.block_size == dt.block_size else \
        f"P {pt.block_size} and D {dt.block_size} (copied token by token)"
    return Check("layout", PASS, f"{pt.num_layers} layers, {sizes} tokens/block, "
                 f"{pt.kv_heads * pt.tp_size} KV heads of {pt.head_bytes} B, {pt.kv_layout or 'NHD'} on both")


def check_advertised(side: Side, other: Side) -> Check:
    """What it tells peers to dial (control, Mooncake session) must be routable from the other host."""
    name = f"advertise {side.label}"
    if side.topology is None:
        return Check(name, SKIP, "it did not answer")
    across = not (is_local(side.host) and is_local(other.host)) and side.host != other.host
    told = {"control at": host_of(side.topology.control),
            "Mooncake session at": host_of(f"x://{side.topology.session}")}
    bad = [f"{what} {host}" for what, host in told.items() if host and (host in WILDCARDS or
                                                                       (across and is_local(host)))]
    if bad:
        return Check(name, FAIL, f"{side.label} advertises {', '.join(bad)} while P and D are on different "
                     f"hosts (dialled at {side.host}): its peer would dial its own machine",
                     "start it with --advertise-host <an address the other host routes to> (vLLM: "
                     "transport.advertise_host), and bind_host that address or 0.0.0.0")
    return Check(name, PASS, f"control at {told['control at']}, Mooncake session at {side.topology.session or '-'}")


def check_mooncake(p: Side, d: Side) -> Check:
    if p.topology is None or d.topology is None:
        return Check("mooncake transport", SKIP, "a side did not answer")

    def said(t: Any) -> str:
        forced = ", MC_FORCE_TCP set" if t.force_tcp else ""
        return f"{t.protocol or '?'}{(' on ' + t.device_name) if t.device_name else ''}{forced}"
    pt, dt = p.topology, d.topology
    problems = []
    if pt.force_tcp != dt.force_tcp:
        problems.append(f"MC_FORCE_TCP is set on {'P' if pt.force_tcp else 'D'} only")
    effective = ["tcp" if t.force_tcp else t.protocol for t in (pt, dt)]
    if effective[0] != effective[1]:
        problems.append(f"P uses {effective[0]}, D uses {effective[1]}")
    if problems:
        return Check("mooncake transport", FAIL, f"{'; '.join(problems)} (P: {said(pt)}; D: {said(dt)})",
                     "configure both alike: MC_FORCE_TCP=1 in both engines' environment for TCP, or unset on "
                     "both with transport.protocol rdma (--protocol rdma) and each host's device_name")
    return Check("mooncake transport", PASS, f"P: {said(pt)}; D: {said(dt)}")
