"""uvicorn's pieces as the server runs them: its HTTP/1.1 protocol with a deadline on each
request's headers, and a server that remembers which signal stopped it and drains its requests.

uvicorn closes an idle kept-alive connection, but a client that has sent part of a request line or
of its headers holds its connection (and a file descriptor) for as long as it likes; enough of them
and the server takes no one else. The deadline runs from the connection's start, and again from
the end of each answer, until the next request's headers are complete; the body has its own
(``Server._read``).
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("uvicorn.error")


class StoppableServer(uvicorn.Server):
    """uvicorn's server, remembering the signal that stopped it (``stopped_by``), with a drain of
    its own. uvicorn raises the signal again once it has shut down, but a process that started
    with SIGINT ignored (a shell's background job) would then carry on and exit 0; the command line
    returns the signal's status from this instead.

    On a signal it stops listening, closes idle connections and lets the requests in flight run
    for the drain (uvicorn's ``timeout_graceful_shutdown``; a second signal ends it at once). Then,
    where uvicorn would cancel every request task (logging an ERROR and cutting each stream with no
    end), it calls ``on_drain_end`` (the app ends its requests with finish reason "abort", so every
    stream gets its final event and ``[DONE]``), lets those last events go out for up to
    ``END_S``, and only then cancels what is left (bodies still being read, clients not reading).
    """

    stopped_by: int | None = None
    hurry = False                 # a second signal: the drain ends now
    END_S = 5.0
    POLL_S = 0.05

    def __init__(self, config, on_drain_start=None, on_drain_end=None):
        """on_drain_start(): the drain begins; on_drain_end() -> int: end what is still running
        (how many requests that was)."""
        super().__init__(config)
        self.on_drain_start, self.on_drain_end = on_drain_start, on_drain_end

    def handle_exit(self, sig, frame):
        if self.should_exit:
            self.hurry = True
        self.stopped_by = self.stopped_by or sig
        if sig not in self._captured_signals:   # raised again once at the end (the second would be lost)
            self._captured_signals.append(sig)
        self.should_exit = True

    async def shutdown(self, sockets=None):
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        if self.on_drain_start is not None:
            self.on_drain_start()
        for connection in list(self.server_state.connections):
            connection.shutdown()           # idle ones close; busy ones close after their answer
        if not await self._settled(self.config.timeout_graceful_shutdown):
            ended = self.on_drain_end() if self.on_drain_end is not None else 0
            if ended:
                log.warning("dsv41 serve: %d request(s) still running when the drain ended: finished "
                            "with finish_reason \"abort\"", ended)
            self.hurry = False              # the final events get their own bound
            if not await self._settled(self.END_S):
                for task in self.server_state.tasks:
                    task.cancel()
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()

    async def _settled(self, seconds: float) -> bool:
        """Wait until no request task is left (True), at most ``seconds`` or until a second signal."""
        deadline = asyncio.get_running_loop().time() + seconds
        while self.server_state.tasks:
            if self.hurry or asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(self.POLL_S)
        return True


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
    """A stopping server cancels the request tasks still left once their final events had their
    time (``StoppableServer.END_S``: clients that do not read), and uvicorn logs each as "Exception
    in ASGI application" with a traceback; that is the bound working, not a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))
