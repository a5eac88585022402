"""The checks a receive registration must pass, one copy for every path into the receiver
(``ReceiveSpec.check`` for the embedding API, ``Receiver.register`` for the node and the loop).
No I/O.
"""

from __future__ import annotations

from ..errors import ConfigError

MIN_TOKEN_CHARS = 16   # a transfer's secret: short tokens are guessable by any peer that can reach D


def check_token(transfer_id: str, token: object) -> None:
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"transfer {transfer_id}: a token of at least {MIN_TOKEN_CHARS} characters is required")


def check_senders(transfer_id: str, senders: object) -> None:
    if isinstance(senders, bool) or not isinstance(senders, int) or senders < 1:
        raise ConfigError(f"transfer {transfer_id}: senders must be a positive integer, got {senders!r}")
