"""A deadline on request headers, for uvicorn's HTTP protocols (issue 31.8).

uvicorn times out idle keep-alive connections, and the server times out a slow body (408,
``--body-timeout``), but nothing bounds how long a client may take to send its request line and
headers: a client sending one header byte every few seconds (slowloris) held a connection, and
its memory, forever. :func:`with_header_deadline` wraps uvicorn's protocol class (httptools' or
h11's, whichever uvicorn picked) so that a connection whose next request's headers have not all
arrived within ``timeout_s`` of the connection opening, or of its previous response ending, is
closed. No response can be sent: with the headers incomplete there is no request to answer
(nginx's ``client_header_timeout`` does the same with a 408 it never sends either).

The check works on the protocol's public per-request state: both implementations make a new
request cycle (``self.cycle``) when a request's headers are complete, so "no new cycle since the
deadline was armed, and none in progress" means the headers did not arrive in time.
"""

from __future__ import annotations

import logging

__all__ = ["with_header_deadline"]

log = logging.getLogger("deepinfer_core.serve")


def with_header_deadline(base: type, timeout_s: float) -> type:
    """A subclass of the uvicorn HTTP protocol ``base`` that enforces the header deadline."""
    if not timeout_s > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {timeout_s}")

    class HeaderDeadlineProtocol(base):
        header_timeout_s = timeout_s

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_deadline()  # the next request on this connection

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _disarm_header_deadline(self) -> None:
            timer, self._header_timer = getattr(self, "_header_timer", None), None
            if timer is not None:
                timer.cancel()

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._cycle_at_arming = self.cycle
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

        def _header_deadline_passed(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            in_progress = cycle is not None and not cycle.response_complete
            if cycle is not self._cycle_at_arming or in_progress or self.transport.is_closing():
                return  # headers arrived (a request is being or was answered): nothing to do
            client = "%s:%d" % tuple(self.client[:2]) if self.client else "a client"
            log.info(
                "closed the connection from %s: its request headers did not arrive within %g s",
                client,
                self.header_timeout_s,
            )
            self.transport.close()

    HeaderDeadlineProtocol.__name__ = HeaderDeadlineProtocol.__qualname__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadlineProtocol
