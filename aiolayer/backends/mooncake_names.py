"""The name P writes to for each process behind a Mooncake session.

Mooncake keeps a segment's descriptor (the peer's data port and buffers) and its connections by the name
written to, for the life of the engine: no call drops them, and over TCP a segment is never re-checked.
A D that restarts and gets a port its dead predecessor had (Mooncake draws it from 15000-17000) then
shows P a session name P already holds: P's writes go to the old data port, and fail until P restarts,
or land in whatever process holds that port now, reported as written (docs/mooncake.md, "A reused
session name"). So each new incarnation behind a name gets a name of its own: the port with one more
leading zero, which Mooncake parses as the same port and opens as a new segment.
"""

from __future__ import annotations


class SegmentNames:
    def __init__(self) -> None:
        # session -> (its latest incarnation, the name written to for it, how many incarnations it had);
        # one entry per session ever written to, as Mooncake keeps one segment (~19 KiB) per name itself
        self._names: dict[str, tuple[str, str, int]] = {}

    def target_for(self, session: str, incarnation: str) -> str:
        known = self._names.get(session)
        if known is None:
            self._names[session] = (incarnation, session, 0)
            return session
        latest, name, seen = known
        if incarnation == latest:
            return name
        host, _, port = session.rpartition(":")
        if not (host and port.isdigit()):   # a name a metadata server resolves: no port to pad
            return session
        name = f"{host}:{'0' * (seen + 1)}{port}"
        self._names[session] = (incarnation, name, seen + 1)
        return name

    def __len__(self) -> int:
        return len(self._names)
