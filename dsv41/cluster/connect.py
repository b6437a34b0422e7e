"""Reaching the cards' dask workers: start a LocalCluster or join ``--address``, then wait for one
single-threaded worker per card, named 0..EP-1, all within one timeout.

Every failure (malformed or unreachable address, workers missing, misnamed or multi-threaded) is a
``ConnectError`` with one line saying what was expected and what the scheduler has.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import socket
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Callable

DEFAULT_TIMEOUT_S = 30.0
POLL_S = 0.1
ABANDON_S = 2.0     # closing the client, then the cluster, of a start-up that did not finish
# loggers that report, at exit, the parts of an interrupted start-up that were cut short
ABANDONED_LOGGERS = ("distributed", "tornado.application", "asyncio")


class ConnectError(RuntimeError):
    pass


@dataclass(frozen=True)
class Startup:
    """How to wait for the cluster and whom to tell: ``on_workers(ready, expected)`` while workers
    join, ``on_ready(dashboard_link or None)`` once every card's worker is there."""
    timeout: float = DEFAULT_TIMEOUT_S
    on_workers: Callable[[int, int], None] | None = None
    on_ready: Callable[[str | None], None] | None = None


class _ClosedTab(logging.Filter):
    """Drops the one known record of a dashboard tab closed while Bokeh was sending to it: tornado's
    write task ends in WebSocketClosedError, nobody awaits it, and asyncio ("Task exception was never
    retrieved") or tornado's IOLoop ("Exception in callback") logs it with a traceback. Bokeh already
    ends that session; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tornado.websocket import WebSocketClosedError
        return not (record.exc_info and isinstance(record.exc_info[1], WebSocketClosedError))


CLOSED_TAB_LOGGERS = ("asyncio", "tornado.application")


def quiet_closed_tabs() -> None:
    """Keep a closed dashboard tab's traceback out of the run's output (once per process)."""
    for name in CLOSED_TAB_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _ClosedTab) for f in log.filters):
            log.addFilter(_ClosedTab())


SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")     # dask's network comms; a scheduler listens on one of them
PORTED = ("tcp", "tls", "ws", "wss")
TLS_SCHEMES = ("tls", "wss")   # need a distributed.security.Security, which no flag builds


def check_address(address: str) -> str | None:
    """What is wrong with a scheduler address (None when it parses as dask reads it)."""
    from distributed.comm.addressing import parse_address, parse_host_port
    example = "expected e.g. tcp://127.0.0.1:8786"
    try:
        scheme, loc = parse_address(address, strict=False)
        if scheme in ("http", "https"):
            return (f"{scheme}:// is not a dask scheduler address (a dashboard's, perhaps); the scheduler "
                    f"listens on tcp://, {example}")
        if scheme not in SCHEMES:
            return f"not a scheduler address (scheme {scheme}:// is none of {', '.join(SCHEMES)}); {example}"
        if scheme in TLS_SCHEMES:
            return (f"{scheme}:// needs TLS settings (a CA, a certificate and a key), which this command does not "
                    f"take; reach the scheduler over tcp:// (e.g. through an SSH tunnel), {example}")
        if scheme in PORTED:
            _, port = parse_host_port(loc)
            if not 1 <= port <= 65535:
                return f"port {port} out of range [1, 65535]; {example}"
    except ValueError as e:
        return f"not a scheduler address ({e}); {example}"
    return None


def connect(cards: int, address: str | None, dashboard: bool, startup: Startup = Startup(),
            scratch: str | None = None):
    """(LocalCluster or None, Client) once every card's worker is there. scratch: the LocalCluster's
    workers keep their files there (the caller removes it)."""
    import dask
    from distributed import Client, LocalCluster

    deadline = time.monotonic() + startup.timeout
    where = f"--address {address}" if address else "the LocalCluster"
    cluster = client = None
    try:
        if address is None:
            if dashboard:     # the dashboard's Bokeh server runs in this process, with the scheduler
                quiet_closed_tabs()
            # multiprocessing's resource tracker unblocks SIGINT/SIGTERM in the thread that starts it:
            # started here first, it cannot undo the mask _keep_stop_signals_from_workers sets
            resource_tracker.ensure_running()
            # started empty and scaled, so workers can be counted as they join; the scheduler's scratch
            # space follows dask's temporary-directory, the workers' their local_directory
            with dask.config.set({"temporary-directory": scratch} if scratch else {}):
                cluster = LocalCluster(n_workers=0, threads_per_worker=1, processes=True,
                                       dashboard_address=":8787" if dashboard else None, silence_logs=40,
                                       local_directory=scratch, preload=["dsv41.cluster.quiet_worker"])
            cluster.sync(_keep_stop_signals_from_workers)
            cluster.scale(cards)
            client = Client(cluster, timeout=startup.timeout)
        else:
            problem = (check_address(address) or _probe(address, startup.timeout)
                       or _handshake(address, deadline, startup.timeout))
            if problem:
                raise ConnectError(f"{where}: {problem}")
            try:
                client = Client(address, timeout=max(0.1, deadline - time.monotonic()))
            except OSError as e:   # the scheduler answered the probe, then went (dask's time-outs are OSErrors)
                raise ConnectError(f"{where}: the dask scheduler stopped answering ({type(e).__name__}: {e})"
                                   ) from None
        _wait_for_cards(client, cards, deadline, where, startup)
    except BaseException as e:
        _abandon(cluster, client, interrupted=isinstance(e, KeyboardInterrupt))
        raise
    if startup.on_ready is not None:
        startup.on_ready(client.dashboard_link if dashboard else None)
    return cluster, client


async def _keep_stop_signals_from_workers() -> None:
    """Block SIGINT and SIGTERM in dask's loop thread (run there, before any worker exists): the
    threads it starts and the worker processes they spawn inherit the mask, so a terminal's Ctrl-C,
    sent to the whole process group, cannot reach a worker still importing, before its preload
    (``quiet_worker``) ignores both, where it died with a traceback of its own. The main thread,
    which handles them for the run, is unaffected."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def quiet_abandoned_start() -> None:
    """Silence what dask logs about a start-up cut short by an interrupt (a nanny whose process was
    killed, a broadcast to a worker that is closing, a scratch folder already removed): the process
    is about to exit with its own one line."""
    for name in ABANDONED_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _abandon(cluster, client, interrupted: bool) -> None:
    """Undo a start-up that did not finish (a refusal, or Ctrl-C / SIGTERM at any moment of it) in
    bounded time and without raising over what ended it. Interrupted, the worker processes still
    starting are killed first, and again at exit (``_kill_started_processes``). Then the client and
    the cluster are closed, each failure of theirs swallowed: an interrupted start leaves dask's loop
    half-way, and its close can fail with errors of its own (``UnboundLocalError: 'result'``) that
    must not replace the interrupt; a cluster that could not close is left out of dask's own close at
    exit (which would wait 10 s for it). The process is about to exit: what dask logs about the parts
    cut short (a nanny whose process was killed, a scratch folder already removed) is silenced."""
    if interrupted and cluster is not None:
        quiet_abandoned_start()
        _kill_started_processes()
        # atexit runs last-registered first: this pass comes before multiprocessing's own exit,
        # which removes the semaphores a worker spawned meanwhile would still read
        atexit.register(_kill_started_processes)
    for part in (client, cluster):
        if part is not None:
            try:
                part.close(timeout=ABANDON_S)
            except Exception:
                pass
    if interrupted and cluster is not None:
        cluster.shutdown_on_close = False


def _kill_started_processes() -> None:
    """SIGKILL every child of this process but multiprocessing's resource tracker, and reap them.

    Dask's nannies start their workers from threads of their own, so at an interrupt a worker can
    be anywhere in its start: not yet in ``multiprocessing.active_children()`` (spawned, its
    ``Process.start`` still writing to it), or importing while its parent exits. Left alone, such a
    worker reads its queues' semaphores after the exit removed them and prints a
    ``FileNotFoundError`` traceback on the run's stderr. Workers still starting have done no work
    worth an orderly close (and the exit would otherwise wait ~10 s for each to finish starting)."""
    import psutil
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    children = [c for c in psutil.Process().children() if c.pid != tracker]
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    listed = multiprocessing.active_children()
    known = {p.pid for p in listed}
    for process in listed:                               # reaped through multiprocessing's bookkeeping
        process.join(ABANDON_S)
    psutil.wait_procs([c for c in children if c.pid not in known], timeout=ABANDON_S)


def _probe(address: str, timeout: float) -> str | None:
    """Fail fast on a TCP address nobody listens on, instead of dask retrying until the timeout."""
    from distributed.comm.addressing import parse_address, parse_host_port
    scheme, loc = parse_address(address, strict=False)
    if scheme != "tcp":
        return None
    host, port = parse_host_port(loc)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "connection refused: no dask scheduler listens there"
    except socket.gaierror as e:
        return f"unknown host {host!r} ({e.strerror})"
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return f"unreachable ({e.strerror or e})"
    return None


def _handshake(address: str, deadline: float, timeout: float) -> str | None:
    """Dask's handshake and an ``identity`` call, within what is left of the deadline: dask's own
    ``connect`` waits for the handshake reply without a time limit, so a peer that accepts and then
    stays silent (or speaks another protocol) would hang the client."""
    import asyncio

    from distributed.comm import connect as comm_connect

    async def identity():
        comm = await comm_connect(address, timeout=max(0.1, deadline - time.monotonic()))
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    try:
        reply = asyncio.run(asyncio.wait_for(identity(), max(0.1, deadline - time.monotonic())))
    except asyncio.TimeoutError:
        return f"no answer to dask's handshake within {timeout:g} s: not a dask scheduler, or a stuck one"
    except Exception as e:     # whatever a peer speaking another protocol makes the decoder raise
        return f"not a dask scheduler (the dask handshake failed: {type(e).__name__}: {e})"
    if not isinstance(reply, dict) or reply.get("type") != "Scheduler":
        kind = reply.get("type") if isinstance(reply, dict) else type(reply).__name__
        return f"not a dask scheduler (it answers as {kind!r})"
    return None


def _wait_for_cards(client, cards: int, deadline: float, where: str, startup: Startup) -> None:
    expected = {str(c) for c in range(cards)}
    seen = -1
    while True:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        by_name = {str(w.get("name")): w for w in workers.values()}
        threaded = sorted(n for n in expected & set(by_name) if by_name[n].get("nthreads") != 1)
        if threaded:
            raise ConnectError(f"{where}: expected {_want(cards)}; {_have(workers)}")
        ready = len(expected & set(by_name))
        if ready != seen and startup.on_workers is not None:
            startup.on_workers(ready, cards)
        seen = ready
        if ready == cards:
            return
        if time.monotonic() >= deadline:
            raise ConnectError(f"{where}: expected {_want(cards)} within {startup.timeout:g} s; {_have(workers)}")
        time.sleep(POLL_S)


def _want(cards: int) -> str:
    names = "0" if cards == 1 else f"0..{cards - 1}"
    return f"{cards} worker(s) named {names} with one thread each"


def _have(workers: dict) -> str:
    if not workers:
        return "the scheduler has no workers"
    listed = ", ".join(f"'{w.get('name')}' ({w.get('nthreads')} thread{'s' if w.get('nthreads') != 1 else ''})"
                       for w in sorted(workers.values(), key=lambda w: str(w.get("name"))))
    return f"the scheduler has {len(workers)}: {listed}"
