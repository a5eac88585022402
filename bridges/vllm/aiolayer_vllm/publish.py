"""D's registrations POSTed to the proxy: one HTTP client per rank, bounded retries.

The client is made on first use and closed on the runtime's loop (``close``), the only thread that
uses it; a refusal by the proxy (4xx) is not retried.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec

from aiolayer import ControlError, Registration, Timeouts

from .params import DecodeRegistration
from .ranks import Topology

if TYPE_CHECKING:
    import httpx


class RegistrationPublisher:
    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._http: httpx.AsyncClient | None = None   # made and closed on the loop

    async def publish(self, reg: Registration, url: str, transfer_id: str, timeouts: Timeouts) -> None:
        """POST the registration to the proxy (bounded retries); raising gives the transfer up.

        ``transfer_id`` is the proxy's (the request's); ``rank``/``ranks`` say which of D's tensor-parallel
        ranks this is: the proxy hands P every rank's endpoint once all of them registered."""
        import httpx

        topo = self.topology
        try:   # checked as the proxy will: a registration it would refuse is not sent
            body = msgspec.to_builtins(DecodeRegistration(transfer_id=transfer_id, registration=reg,
                                                          rank=topo.tp_rank, ranks=topo.tp_size, dp_rank=topo.dp_rank))
        except ValueError as exc:
            raise ControlError(f"registration not published to {url}: {exc}") from None
        error = ""
        if self._http is None:   # made once: a client's TLS set-up alone costs ~20 ms per request
            self._http = httpx.AsyncClient(timeout=timeouts.control_call)
        deadline = asyncio.get_running_loop().time() + timeouts.done_delivery   # all attempts together
        for attempt in range(timeouts.control_retries):
            if attempt and asyncio.get_running_loop().time() >= deadline:
                error += f" (gave up after {attempt} attempts, done_delivery {timeouts.done_delivery:g} s)"
                break
            try:
                reply = await self._http.post(url, json=body)
            except Exception as exc:  # noqa: BLE001 - httpx raises more than HTTPError (InvalidURL)
                error = f"{type(exc).__name__}: {exc}"
            else:
                if reply.status_code < 300:
                    return
                error = f"HTTP {reply.status_code}: {reply.text[:200]}"
                if reply.status_code < 500:
                    break  # the proxy refused it (e.g. 404 unknown transfer): retrying will not help
            await asyncio.sleep(0.05 * (attempt + 1))
        raise ControlError(f"registration not published to {url}: {error}")

    async def close(self) -> None:
        client, self._http = self._http, None
        if client is not None:
            await client.aclose()
