"""Where a process listens, what it tells peers to dial, and which Mooncake transport carries the KV.

One struct (``Transport``), read in one place (``NodeConfig.transport``); the same keys in the vLLM
connector's ``kv_connector_extra_config["transport"]`` and as ``aiolayer node`` flags.

Bind vs advertise: sockets bind ``bind_host`` (127.0.0.1 by default: nothing listens beyond this
machine unless you say so). Peers are told ``advertised()``: ``advertise_host`` if set, else the bind
host, else (a wildcard bind) the address of the interface that routes to the outside, as vLLM's
``get_ip()`` finds it; loopback only when the machine has no other address. Never 0.0.0.0.
Mooncake's own data listener takes no bind address (it listens on every interface, a Mooncake
fact); it is told the advertised host, which peers use as its segment name.

IPv6: the control plane and /metrics bind and dial IPv6 addresses (``url_host`` brackets them in
endpoints); Mooncake 0.3 does not (``Transport.check_mooncake`` refuses it, before any I/O).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

import msgspec

from .errors import BackendError, ConfigError, ControlError

PROTOCOLS = ("tcp", "rdma", "ascend")   # Mooncake's; "ascend" only on Ascend builds (mooncake-transfer-engine-npu)
WILDCARDS = ("0.0.0.0", "::")
RDMA_DEVICES = "/sys/class/infiniband"
MOONCAKE_IPV6 = ("IPv6 address {!r}: IPv6 is not supported with the mooncake backend yet (its handshake cannot "
                 "reach an IPv6 peer); give an IPv4 bind_host/advertise_host "
                 "(the control plane itself works over IPv6)")
_SIOCGIFADDR = 0x8915


def check_metadata_server(value: str) -> str:
    """An unknown scheme (e.g. redis://) aborts the process inside Mooncake: refuse it here."""
    if value == "P2PHANDSHAKE" or value.startswith(("http://", "https://", "etcd://")):
        return value
    raise ConfigError(f"metadata server must be P2PHANDSHAKE, http(s):// or etcd://, got {value!r}")


class Transport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    protocol: str = "tcp"                    # Mooncake transport: tcp, rdma, ascend
    device_name: str = ""                    # RDMA NIC(s), comma-separated (e.g. "mlx5_0"); "" = Mooncake picks
    metadata_server: str = "P2PHANDSHAKE"    # or an http(s):// or etcd:// metadata server
    bind_host: str = "127.0.0.1"             # control sockets and /metrics bind this address
    advertise_host: str = ""                 # what peers dial; "" = see the module docstring

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"transport protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        check_metadata_server(self.metadata_server)
        _check_ip("bind_host", self.bind_host)
        if self.advertise_host:
            _check_ip("advertise_host", self.advertise_host)
            if self.advertise_host in WILDCARDS:
                raise ConfigError(f"advertise_host {self.advertise_host!r} is not an address a peer can dial")

    def check_mooncake(self) -> None:
        """Mooncake (0.3) cannot handshake with an IPv6 peer (it fails to resolve ``[::1]:port``):
        refuse an IPv6 address Mooncake would be told, where it is known before start."""
        told = self.advertise_host or ("" if self.bind_host in WILDCARDS else self.bind_host)
        if ":" in told:
            raise ConfigError(MOONCAKE_IPV6.format(told))

    def advertised(self) -> str:
        """The host peers are told to dial (never a wildcard)."""
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host not in WILDCARDS:
            return self.bind_host
        return routed_host()


def _check_ip(name: str, value: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an IP address, got {value!r}") from exc


def url_host(host: str) -> str:
    """``host`` as it goes into tcp:// and http:// URLs (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host else host


def routed_host() -> str:
    """The local address the default route leaves from; else the first non-loopback interface
    address; else 127.0.0.1. A UDP "connect" sends nothing: it only asks the kernel for a route."""
    for family, probe in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe_socket:
                probe_socket.connect((probe, 80))
                return probe_socket.getsockname()[0]
        except OSError:
            continue
    return _first_interface_address() or "127.0.0.1"


def _first_interface_address() -> str:
    """The first IPv4 address of an interface other than loopback (Linux ioctl), "" if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue   # no IPv4 address on this one
            address = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                return address
    return ""


def check_rdma_devices(device_name: str, root: str = RDMA_DEVICES) -> list[str]:
    """The RDMA devices this host has; refuses at once (a clear error, not a hang) when there is
    none, or when a named one is missing."""
    found = sorted(os.listdir(root)) if os.path.isdir(root) else []
    if not found:
        raise BackendError(f"transport protocol 'rdma' needs an RDMA device, and this host has none ({root} is "
                           "empty or missing): install the NIC's driver (rdma-core) or use protocol 'tcp'")
    wanted = [name.strip() for name in device_name.split(",") if name.strip()]
    missing = [name for name in wanted if name not in found]
    if missing:
        raise BackendError(f"RDMA device {', '.join(missing)} not found; this host has {', '.join(found)}")
    return found


MAX_ENDPOINT_CHARS = 256


def check_endpoint(endpoint: object) -> str:
    """``endpoint`` if it can name a ZMQ peer (printable ASCII ``transport://address``, a tcp port in
    1..65535), else ``ControlError``: a port ZMQ cannot dial is no peer that "does not answer"."""
    if not isinstance(endpoint, str):
        raise ControlError(f"peer endpoint must be a string, got {type(endpoint).__name__}")
    if not endpoint.isascii() or not endpoint.isprintable() or " " in endpoint:
        raise ControlError(f"peer endpoint {endpoint!r} must be printable ASCII without spaces")
    if len(endpoint) > MAX_ENDPOINT_CHARS or "://" not in endpoint:
        raise ControlError(f"peer endpoint {endpoint[:80]!r} is not transport://address "
                           f"of at most {MAX_ENDPOINT_CHARS} characters")
    port = endpoint.rpartition(":")[2]
    if endpoint.startswith("tcp://") and not (port.isdigit() and 0 < int(port) < 65536):
        raise ControlError(f"peer endpoint {endpoint!r}: its port must be in 1..65535")
    return endpoint
