"""The `raw_tcp` receiver: a child process that takes plain TCP streams on 127.0.0.1 into one buffer.

``python -m aiolayer.bench.perf.tcp_sink`` prints ``{"port": N}`` and serves until stdin closes. Each
stream of a request sends a header (request id, offset, length, total, chunk, streams) and then its
bytes. The stream that completes the request answers ``b"A"`` at once (P stops its clock on it), then
the CRC32 of every ``chunk`` bytes of the buffer (one per layer's K or V), so P can check every byte;
the other streams answer ``b"P"``.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import zlib

import numpy as np

HEADER = struct.Struct("!QQQQQI")   # request id, offset, length, total, chunk, streams


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` completely, or raise if the peer closes first."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


class _Sink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer = np.zeros(0, dtype=np.uint8)
        self.pending: dict[int, int] = {}   # request id -> streams still receiving

    def buffer_for(self, total: int) -> np.ndarray:
        with self.lock:
            if self.buffer.size != total:
                self.buffer = np.zeros(total, dtype=np.uint8)  # zeroed: pages faulted before timing starts
            return self.buffer

    def serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                rid, offset, length, total, chunk, streams = HEADER.unpack(recv_exact(conn, HEADER.size))
                if length == 0:        # a set-up message: size the buffer, fault its pages
                    self.buffer_for(total)
                    conn.sendall(b"R")
                    continue
                recv_into_exact(conn, memoryview(self.buffer_for(total))[offset:offset + length])
                with self.lock:
                    left = self.pending.get(rid, streams) - 1
                    self.pending[rid] = left
                if left:
                    conn.sendall(b"P")
                    continue
                del self.pending[rid]
                conn.sendall(b"A")
                buf = self.buffer[:total]
                crcs = [zlib.crc32(buf[i:i + chunk]) for i in range(0, total, chunk)]
                body = json.dumps(crcs).encode()
                conn.sendall(struct.pack("!I", len(body)) + body)
        except (ConnectionError, OSError, struct.error):
            pass
        finally:
            conn.close()


def main() -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
    sink = _Sink()

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=sink.serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()    # the parent closes our stdin (or dies): then we go
    srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
