"""Frozen configuration: the named deadlines (``Timeouts``), the KV shape and the node settings.

Every wait in aiolayer takes its deadline from one ``Timeouts`` instance; nothing hard-codes one.
A wait that spans several phases uses a named sum (``Timeouts.quarantine_wait`` ...), defined and
checked here, never one added up at the call site.
"""

from __future__ import annotations

import msgspec

from .errors import ConfigError
from .protocol.messages import MAX_KEY_CHARS as MAX_ENGINE_ID   # a peer refuses a frame naming a longer one
from .transport import Transport

DEFAULT_INTEGRITY_SAMPLE = 0.01   # share of layers checked end to end: a digest pass over ~1 % of the bytes
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1, "uint8": 1}
# The longest any one named deadline may be: every wait ends (no infinity), and a deadline's sums and
# the clocks it is added to stay far inside what ``threading`` and ``time`` accept (1e10 s overflows them).
MAX_DEADLINE_S = 86_400.0
MIN_FRAME_BYTES = 64 << 10   # a step's DONE or layout batch; below it the control plane refuses real frames
MAX_DIMENSION = 1 << 24      # any one KVShape dimension (blocks, heads...): far past real engines, far from int64
MAX_KV_BYTES = 1 << 40       # a KVShape's whole cache (1 TiB): past it no host holds it
MAX_CONTROL_RETRIES = 100    # attempts of one delivery: each waits, so the count bounds the time


def wait_limit(timeout: float, what: str) -> float:
    """A caller's ``timeout`` for a blocking wait, if it is seconds a wait can end in: ``ConfigError`` for
    NaN (a wait that never ends), a negative one, or one past ``MAX_DEADLINE_S`` (it overflows the clock)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_DEADLINE_S:
        raise ConfigError(f"{what}: timeout must be 0 to {MAX_DEADLINE_S:g} seconds, got {timeout!r:.80}")
    return timeout


class Timeouts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Deadlines in seconds, one per named phase. Decoded from user input (the vLLM connector's
    ``timeouts``), a misspelt name is refused, never silently left at its default."""

    control_call: float = 2.0        # one control request -> reply
    control_retries: int = 3         # attempts for DONE/FAILED delivery
    layout_fetch: float = 5.0        # remote layout prefetch, all attempts together
    lookup_wait: float = 30.0        # D: a waiting lookup (late binding: P asks before D registered) is
                                     # held this long for the registration, then answered not_registered
    layer_event: float = 30.0        # device event of a layer to complete
    layer_gap: float = 60.0          # next layer of a started request to arrive from the forward
    layer_write: float = 10.0        # one layer's writes to complete once submitted
    done_delivery: float = 10.0      # DONE/FAILED accepted by D, all attempts together
    receive: float = 120.0           # D: registration -> DONE/FAILED from P; P's writes end then too (the
                                     # window D grants with its layout: docs/fencing.md, rule 8)
    fence_grace: float = 35.0        # D: without P's ack, wait this long before reusing blocks P may write
                                     # (longer than a Mooncake write can stay in flight: MC_TRANSFER_TIMEOUT=30)
    quarantine: float = 60.0         # P: wait for a timed-out write to end before reusing its source
    shutdown: float = 5.0            # whole runtime stop
    cleanup: float = 1.0             # each awaited clean-up step
    backend_close: float = 5.0       # unregister memory and destroy the transfer engine
    peer_idle: float = 60.0          # a control client unused this long is closed when a new peer comes

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name == "control_retries":
                if not 1 <= value <= MAX_CONTROL_RETRIES:
                    raise ConfigError(f"control_retries must be 1 to {MAX_CONTROL_RETRIES}, got {value!r}")
            elif not 0 < value <= MAX_DEADLINE_S:   # NaN fails too
                raise ConfigError(f"timeout {name} must be > 0 and at most {MAX_DEADLINE_S:g} s, got {value!r}")
        for name, parts in COMPOSED.items():
            values = [getattr(self, part) for part in parts]
            total = getattr(self, name)
            if total != sum(values) or (total == float("inf") and all(v < float("inf") for v in values)):
                raise ConfigError(f"deadline {name} = {' + '.join(parts)} overflows: {values!r}")

    # --- composed deadlines (each is the sum its name stands for; ``COMPOSED`` lists the parts) ---

    @property
    def abort_settle(self) -> float:
        """P, answering D's Abort: how long it waits for the transfer's writes to be quiet before it
        answers Nack ``settling`` instead (a write in flight ends within ``layer_write``)."""
        return self.layer_write + self.cleanup

    @property
    def abort_call(self) -> float:
        """D's Abort call to P: P may wait ``layer_write`` before it answers, plus the round trip."""
        return self.layer_write + self.control_call

    @property
    def abort_ask(self) -> float:
        """D's fence, one ask of P: ``abort_call`` plus getting the control client.

        The fence is safe when ``fence_grace`` exceeds both this (the first ask's own round trip) and
        Mooncake's ``MC_TRANSFER_TIMEOUT`` (30 s by default: how long a submitted write can stay in
        flight). The latter is Mooncake's environment, not ours, so only docs/fencing.md states it;
        neither is enforced here, since tests shorten ``fence_grace`` on purpose."""
        return self.layer_write + self.control_call + self.cleanup

    @property
    def lookup_call(self) -> float:
        """P binding a late transfer: D holds its lookup up to ``lookup_wait``, plus the round trip; past
        it the transfer fails, having written nothing."""
        return self.lookup_wait + self.control_call

    @property
    def quarantine_wait(self) -> float:
        """P, a failed transfer: how long it waits for its writes to be quiet before FAILED goes to
        D; past it D is told nothing (its own deadline and fence take over)."""
        return self.quarantine + self.cleanup

    @property
    def runtime_open(self) -> float:
        """``Runtime.start``: open the backend and the control plane (a layout fetch's worth of slack)."""
        return self.shutdown + self.layout_fetch

    @property
    def runtime_close(self) -> float:
        """``Runtime.stop``: close sockets and tasks, then the backend."""
        return self.shutdown + self.backend_close


# name -> the Timeouts fields it adds up (checked in ``Timeouts.__post_init__``)
COMPOSED: dict[str, tuple[str, ...]] = {
    "abort_settle": ("layer_write", "cleanup"),
    "abort_call": ("layer_write", "control_call"),
    "abort_ask": ("layer_write", "control_call", "cleanup"),
    "lookup_call": ("lookup_wait", "control_call"),
    "quarantine_wait": ("quarantine", "cleanup"),
    "runtime_open": ("shutdown", "layout_fetch"),
    "runtime_close": ("shutdown", "backend_close"),
}


class KVShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A paged KV cache: per layer one K and one V tensor [num_blocks, block_size, kv_heads, head_dim]
    (``layout`` "NHD"), or [num_blocks, kv_heads, block_size, head_dim] ("HND")."""

    num_layers: int = 32
    num_blocks: int = 512
    block_size: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    layout: str = "NHD"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; one of {sorted(DTYPE_BYTES)}")
        if self.layout not in ("NHD", "HND"):
            raise ConfigError(f"layout must be 'NHD' or 'HND', got {self.layout!r}")
        for name in ("num_layers", "num_blocks", "block_size", "kv_heads", "head_dim"):
            if not 1 <= getattr(self, name) <= MAX_DIMENSION:
                raise ConfigError(f"{name} must be 1 to {MAX_DIMENSION:,}, got {getattr(self, name)}")
        if self.total_bytes > MAX_KV_BYTES:   # numpy would fail with a traceback, or the OOM killer end it
            raise ConfigError(f"a KV cache of {self.total_bytes:,} bytes (2 x layers x blocks x block_bytes) is over "
                              f"{MAX_KV_BYTES:,}: fewer blocks or layers")

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token: head_dim * dtype."""
        return self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K (or V) tensor."""
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return 2 * self.num_layers * self.layer_bytes


class NodeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where this process listens and how it names itself to peers."""

    engine_id: str = "aiolayer"
    # bind and advertised hosts, Mooncake's protocol, device and metadata server (aiolayer.transport)
    transport: Transport = msgspec.field(default_factory=Transport)
    control_port: int = 0            # 0 = pick a free port
    metrics_port: int = -1           # Prometheus GET /metrics on transport.bind_host: -1 = off, 0 = a free port
    backend: str = "mooncake"        # "mooncake" | "memory"
    max_frame_bytes: int = 1 << 20   # control frames larger than this are refused
    bridge_capacity: int = 65536     # items the forward thread may queue before BridgeFull
    # P: the share of layers (each of every transfer drawn on its own) whose bytes are checksummed end to
    # end (D verifies what landed before it accepts DONE; runtime/integrity.py). Host-memory KV only.
    integrity_sample: float = DEFAULT_INTEGRITY_SAMPLE

    def __post_init__(self) -> None:
        if not 1 <= len(self.engine_id) <= MAX_ENGINE_ID or not self.engine_id.isprintable():
            raise ConfigError(f"engine_id must be 1 to {MAX_ENGINE_ID} printable characters, got "
                              f"{len(self.engine_id)}: {self.engine_id[:40]!r}")   # peers refuse longer ids
        if not 0 <= self.control_port <= 65535:
            raise ConfigError(f"control_port out of range: {self.control_port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port out of range: {self.metrics_port} (-1 = off)")
        if self.max_frame_bytes < MIN_FRAME_BYTES or self.bridge_capacity < 1:   # 0 refused every frame
            raise ConfigError(f"max_frame_bytes must be >= {MIN_FRAME_BYTES} and bridge_capacity >= 1, got "
                              f"{self.max_frame_bytes} and {self.bridge_capacity}")
        if not 0.0 <= self.integrity_sample <= 1.0:
            raise ConfigError(f"integrity_sample must be a share in 0..1, got {self.integrity_sample}")
        if self.backend not in ("mooncake", "memory"):
            raise ConfigError(f"unknown backend {self.backend!r}; 'mooncake' or 'memory'")
        if self.backend == "mooncake":
            self.transport.check_mooncake()
