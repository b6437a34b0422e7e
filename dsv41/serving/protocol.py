"""uvicorn's pieces as the server runs them: its HTTP/1.1 protocol with a deadline on each
request's headers, a server that remembers which signal stopped it, and a quiet drain.

uvicorn closes an idle kept-alive connection, but a client that has sent part of a request line or
of its headers holds its connection (and a file descriptor) for as long as it likes; enough of them
and the server takes no one else. The deadline runs from the connection's start, and again from
the end of each answer, until the next request's headers are complete; the body has its own
(``Server._read``).
"""
from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

# exit statuses of a server stopped by a signal, as a shell reports a process the signal ended
SIGNAL_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StoppableServer(uvicorn.Server):
    """uvicorn's server, remembering the signal that stopped it (``stopped_by``). uvicorn raises the
    signal again once it has shut down, but a process that started with SIGINT ignored (a shell's
    background job) would then carry on and exit 0; the command line returns the signal's status
    from this instead."""

    stopped_by: int | None = None

    def handle_exit(self, sig, frame):
        self.stopped_by = self.stopped_by or sig
        super().handle_exit(sig, frame)


def timed_h11(seconds: float) -> type[H11Protocol]:
    """H11Protocol that closes a connection whose request headers take longer than ``seconds``."""

    class TimedH11(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            self._arm()       # first: the call below may parse a pipelined request at once (and disarm)
            super().on_response_complete()

        def handle_events(self):
            super().handle_events()
            if self.cycle is not self._waiting_after:      # a new request's headers are in
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._waiting_after = self.cycle
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _disarm(self):
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _headers_late(self):
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return TimedH11


class QuietDrainEnd(logging.Filter):
    """A stopping server cancels the requests still in flight when the drain bound passes, and
    uvicorn logs each cancelled one as "Exception in ASGI application" with a traceback; that is
    the bound working, not a fault (uvicorn's one line saying how many it cancelled stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))
