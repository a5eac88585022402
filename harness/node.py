"""A decode node (``aiolayer node``) in a child process, the Mooncake environment every process of the
bench and the tests runs with, and the KV shape flags generated from ``KVShape``'s fields."""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from aiolayer.backends.mooncake import ENGINE_ENV
from aiolayer.config import DTYPE_BYTES, KVShape

from .child import ChildProcess, ChildStartError

# Mooncake settings for every process that creates an engine (queues sized for thousands of writes in
# flight, TCP on loopback). Set before an engine exists.
MOONCAKE_ENV = {**ENGINE_ENV, "MC_FORCE_TCP": "1"}


def mooncake_env(transfer_timeout_s: float | None = None) -> dict[str, str]:
    """MOONCAKE_ENV, with Mooncake's own write timeout (``MC_TRANSFER_TIMEOUT``, whole seconds) if given."""
    env = dict(MOONCAKE_ENV)
    if transfer_timeout_s is not None:
        env["MC_TRANSFER_TIMEOUT"] = str(int(transfer_timeout_s))
    return env


# --- KV shape flags: one per KVShape field, named as ``aiolayer node`` names them --------------------

_FLAG_NAMES = {"layout": "kv-layout"}
_CHOICES = {"dtype": sorted(DTYPE_BYTES), "layout": ["NHD", "HND"]}
_HELP = {"num_layers": "layers of the KV cache", "num_blocks": "blocks per layer", "block_size": "tokens per block",
         "kv_heads": "KV heads per block", "head_dim": "elements per head", "dtype": "element type",
         "layout": "block layout: NHD [block, token, head, dim] or HND [block, head, token, dim]"}


def _shape_fields() -> list[msgspec.structs.FieldInfo]:
    return list(msgspec.structs.fields(KVShape))


def shape_flag(name: str) -> str:
    return "--" + _FLAG_NAMES.get(name, name.replace("_", "-"))


def shape_flags(shape: KVShape, skip: tuple[str, ...] = ()) -> list[str]:
    """``aiolayer node``'s flags that give it ``shape``."""
    out: list[str] = []
    for f in _shape_fields():
        if f.name not in skip:
            out += [shape_flag(f.name), str(getattr(shape, f.name))]
    return out


def add_shape_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults) -> None:
    """One option per KVShape field not in ``skip`` (dest = the field's name), default KVShape's or ``defaults``'."""
    for f in _shape_fields():
        if f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        kind = f.type if f.type in (int, float) else None
        p.add_argument(shape_flag(f.name), dest=f.name, default=default, type=kind, choices=_CHOICES.get(f.name),
                       help=_HELP.get(f.name, f.name.replace("_", " ")))


def shape_from_args(args, **overrides) -> KVShape:
    """A KVShape from the options ``add_shape_args`` made (fields the parser lacks keep KVShape's defaults)."""
    fields = {f.name: getattr(args, f.name) for f in _shape_fields() if hasattr(args, f.name)}
    return KVShape(**{**fields, **overrides})


class NodeProcess(ChildProcess):
    """A decode node in a child process; ``info`` is its JSON line (control endpoint, session...).

    It stays in this process's group: killing the bench's group (a test's deadline) takes it along."""

    def __init__(self, shape: KVShape, backend: str = "mooncake", extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 30.0) -> None:
        cmd = [sys.executable, "-m", "aiolayer", "node", "--role", "decode", "--backend", backend,
               "--exit-with-parent", *shape_flags(shape), *(extra_args or [])]
        super().__init__(cmd, env={**os.environ, **MOONCAKE_ENV, **(env or {})}, name="decode node",
                         new_session=False)
        self.start_timeout = start_timeout
        self.info: dict = {}

    def start(self) -> "NodeProcess":
        super().start()
        try:
            self.info = self.read_json(self.start_timeout)
        except ChildStartError as exc:
            self.stop()
            raise ChildStartError(f"decode node did not report its endpoint within {self.start_timeout:g}s "
                                  f"(exit code {self.proc.returncode}); {exc}") from None
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def control(self) -> str:
        return self.info["control"]

    def __enter__(self) -> "NodeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
