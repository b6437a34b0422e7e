"""Simulated device time per (kernel, shapes, dtypes): a memory + JSON-file cache in front of a worker.

pypto caches nothing (every SIM call recompiles, ~1 s), so the disk cache is what makes a second
process free. Calls are serialized: one worker per mode, one request at a time.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from dsv41.kernels.pypto import env as pypto_env
from dsv41.kernels.pypto.specs import PYPTO_KERNELS, cache_key
from dsv41.outputs import open_append, write_output

log = logging.getLogger("dsv41.pypto")
log.addHandler(logging.NullHandler())  # no stderr fallback over the CLI's output; the CLI may add one

START_TIMEOUT_S = 600.0  # a verify worker may build the calculator first (30-120 s)
# a hung worker is killed after this; FLASH moe.experts (48 experts) takes ~200 s to simulate on 2 cores
CALL_TIMEOUT_S = float(os.environ.get("DSV41_PYPTO_TIMEOUT_S", 900))
LOG_MAX_BYTES = 8 << 20


class SimCache:
    """Entries ``{key: {"us": float | None, "error": str | None, ...}}``; None us = a recorded failure.

    Writes merge into the file under an flock, so processes sharing it add rather than overwrite.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path or pypto_env.cache_file())
        self._mem: dict[str, dict] | None = None
        self._lock = threading.Lock()

    def _read_file(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _entries(self) -> dict:
        if self._mem is None:
            self._mem = self._read_file()
        return self._mem

    def get(self, key: str) -> dict | None:
        with self._lock:
            return self._entries().get(key)

    def put(self, key: str, entry: dict, persist: bool = True) -> None:
        with self._lock:
            self._entries()[key] = entry
            if persist:
                self._merge_to_disk({key: entry})

    def _merge_to_disk(self, new: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open_append(self.path.with_suffix(".lock")) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._read_file()
            data.update(new)
            write_output(self.path, json.dumps(data, indent=1, sort_keys=True))

    def errors(self) -> dict[str, str]:
        with self._lock:
            return {k: v["error"] for k, v in self._entries().items() if v.get("error")}


class PyptoWorker:
    """One worker subprocess for a run mode (sim | verify | npu); restarted after it dies.

    A plain subprocess (``python -m dsv41.kernels.pypto.worker``), not multiprocessing spawn: spawn
    re-imports the caller's __main__, which scripts without a main guard do not survive.
    """

    def __init__(self, mode: str = "sim", root: str | os.PathLike | None = None):
        self.mode, self.root = mode, pypto_env.run_dir(root)
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.arch: str | None = None  # pypto.platform.npuarch as the last started worker reported it
        self._lock = threading.Lock()

    def _start(self) -> dict | None:
        self.root.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(pypto_env.REPO), os.environ.get("PYTHONPATH")) if p)}
        log_file = self.root / f"worker-{self.mode}.log"
        if log_file.exists() and log_file.stat().st_size > LOG_MAX_BYTES:
            log_file.replace(log_file.with_suffix(".log.old"))
        with open_append(log_file) as console:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dsv41.kernels.pypto.worker", str(theirs.fileno()), self.mode, str(self.root)],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                env=env, cwd=self.root)
        theirs.close()
        self._conn = Connection(ours.detach())
        reply = self._recv(START_TIMEOUT_S)
        if not reply.get("ready"):
            return reply
        self.arch = reply.get("arch")
        return None

    def _recv(self, timeout: float) -> dict:
        try:
            if self._conn.poll(timeout):
                return pickle.loads(self._conn.recv_bytes())
            self._stop(kill=True)
            return {"ok": False, "error": f"pypto worker timed out after {timeout:.0f} s", "transient": True}
        except (EOFError, OSError):
            code = self._stop(kill=False)
            why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return {"ok": False, "error": f"pypto worker died ({why})"}

    def _stop(self, kill: bool) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if kill:
            proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(Exception):
            self._conn.close()
        # a worker killed mid-call leaves its output dir (1-9 MB) behind
        for left in (self.root / "out").glob(f"output_*_{proc.pid}_*"):
            shutil.rmtree(left, ignore_errors=True)
        return proc.returncode

    def run(self, kernel: str, shapes: dict, dtypes: dict, args=None, timeout: float = CALL_TIMEOUT_S) -> dict:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                failed = self._start()
                if failed:
                    self._stop(kill=True)
                    return {**failed, "transient": True}
            try:
                self._conn.send_bytes(pickle.dumps((kernel, shapes, dtypes, args)))
            except OSError:
                pass  # it died between calls; _recv reports how
            reply = self._recv(timeout)
            if not reply.get("ok") or reply.pop("retire", False):
                self._stop(kill=False)  # it exits after a failure (its pypto state is spoiled) or past its RSS cap
            return reply

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                with contextlib.suppress(Exception):
                    self._conn.send_bytes(pickle.dumps(None))
                self._stop(kill=False)


_WORKERS: dict[tuple[str, str], PyptoWorker] = {}
_WORKERS_LOCK = threading.Lock()


def worker(mode: str = "sim", root=None) -> PyptoWorker:
    key = (mode, str(pypto_env.run_dir(root)))
    with _WORKERS_LOCK:
        if key not in _WORKERS:
            _WORKERS[key] = PyptoWorker(mode, root)
        return _WORKERS[key]


@atexit.register
def close_workers() -> None:
    for w in list(_WORKERS.values()):
        w.close()


class SimFailed(RuntimeError):
    def __init__(self, msg: str, transient: bool = False):
        super().__init__(msg)
        self.transient = transient


def worker_simulate(mode: str = "sim") -> Callable[[str, dict, dict], float]:
    def simulate(kernel: str, shapes: dict, dtypes: dict) -> float:
        reply = worker(mode).run(kernel, shapes, dtypes)
        if not reply.get("ok"):
            raise SimFailed(reply.get("error", "unknown failure"), reply.get("transient", False))
        return float(reply["us"])
    return simulate


_DEFAULT_CACHE: SimCache | None = None


def default_cache() -> SimCache:
    global _DEFAULT_CACHE
    if _DEFAULT_CACHE is None:
        _DEFAULT_CACHE = SimCache()
    return _DEFAULT_CACHE


BACKEND_MODES = {"pypto-sim": "sim", "pypto-npu": "npu"}


def device_time_us(backend: str, kernel: str, shapes: dict, dtypes=None, **kw) -> float | None:
    """``sim_time_us`` by CLI backend name; pypto-npu first checks for an NPU (RuntimeError if absent)."""
    if backend not in BACKEND_MODES:
        raise ValueError(f"backend: must be one of {sorted(BACKEND_MODES)}, got {backend!r}")
    if backend == "pypto-npu":
        pypto_env.check_npu()
    return sim_time_us(kernel, shapes, dtypes, mode=BACKEND_MODES[backend], **kw)


def sim_time_us(kernel: str, shapes: dict, dtypes=None, *, mode: str = "sim", cache: SimCache | None = None,
                simulate: Callable[[str, dict, dict], float] | None = None) -> float | None:
    """Simulated (mode "sim") or measured (mode "npu") device µs of one kernel call, cached.

    None when the kernel has no pypto form or its run failed (the error is kept in the cache:
    ``cache.errors()``). ``simulate(kernel, shapes, dtypes) -> µs`` replaces the worker (tests).
    Bad shapes or dtype knobs raise ValueError before anything runs.
    """
    spec = PYPTO_KERNELS.get(kernel)
    if spec is None:
        return None
    s, d = spec.normalize(shapes, dtypes)
    key = cache_key(kernel, s, d, mode)
    cache = cache or default_cache()
    hit = cache.get(key)
    if hit is not None:
        return hit["us"]
    if spec.sliced and s[spec.sliced] > 2 * SIM_SLICE and mode == "sim":  # an NPU measures the whole call
        return sliced_time_us(kernel, s, d, key, mode=mode, cache=cache, simulate=simulate)
    simulate = simulate or worker_simulate(mode)
    t0 = time.perf_counter()
    try:
        us = float(simulate(kernel, s, d))
    except Exception as e:
        transient = getattr(e, "transient", False)
        log.warning("pypto %s %s failed: %s", mode, key, e)
        cache.put(key, {"us": None, "error": str(e)}, persist=not transient)
        return None
    wall = time.perf_counter() - t0
    cache.put(key, {"us": us, "error": None, "wall_s": round(wall, 3)})
    log.info("compiled and simulated %s in %.1f s", kernel, wall)
    return us


# Batch entries per slice when a sliced kernel is priced from slices (see sliced_time_us). pypto's
# compile and cost model take memory per simulated task: FLASH moe.experts [16,5120]x[5120,2304]
# per expert (BF16 weights) took 1.0 / 1.3 / 1.6 / 2.2 / 3.0 GB of worker RSS at 2 / 3 / 4 / 6 / 8 experts and the
# whole 48 passed 7 GB (16 GB in issue 32), so slices of 3 and 6 keep a worker below 4 GB.
SIM_SLICE = 3


def sliced_time_us(kernel: str, s: dict, d: dict, key: str, *, mode: str, cache: SimCache,
                   simulate=None) -> float | None:
    """A sliced kernel's µs from two simulated slices of g and 2g batch entries, same tiles as the whole:
    t(g) + (n - g) / g * (t(2g) - t(g)), one pipeline fill and drain plus the per-g cost of the rest.

    FLASH moe.experts with BF16 weights, 48 experts of [16,5120]x[5120,2304]: 123.3 and 215.5 µs at
    3 and 6 give 1506.6 against 1439.5 simulated whole (+4.7%). Cached under the whole call's key.
    """
    dim = PYPTO_KERNELS[kernel].sliced
    g, n = SIM_SLICE, s[dim]
    group = s.get("group") or n
    parts = [sim_time_us(kernel, {**s, dim: k, "group": group}, d, mode=mode, cache=cache, simulate=simulate)
             for k in (g, 2 * g)]
    if any(t is None for t in parts):
        cache.put(key, {"us": None, "error": f"a slice of {dim}={g} or {2 * g} failed"}, persist=False)
        return None
    us = parts[0] + (n - g) / g * (parts[1] - parts[0])
    cache.put(key, {"us": us, "error": None, "from_slices": [g, 2 * g]})
    return us
