"""Ports for the servers and schedulers the tests start, never a port closed and guessed free again.

Wherever a program can take port 0 it does, and the test reads back what the OS gave it
(``listening_port`` for ``dsv41.serve``, ``start_scheduler`` for a dask scheduler); an in-process
server gets a socket already bound (``bound_socket``). Only a port that must be known before its
program starts (a dask worker that comes back at its address) is chosen ahead (``free_ports``).
"""
import json
import random
import re
import socket
import subprocess
import sys
import time

LISTENING = re.compile(r"listening on http://[^\s:]+:(\d+)")


def free_ports(n: int) -> list[int]:
    """n distinct ports, free now, below the kernel's range of ephemeral ports: no outgoing
    connection (a worker's to the scheduler, say) can take one before its program binds it, as it
    could a port that bind(0) handed out and that was closed again. Held bound together while
    chosen, so they differ; drawn at random, so two test runs on the machine rarely meet."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    held = []
    try:
        for port in random.Random().sample(range(max(1024, first_ephemeral - 8000), first_ephemeral), 500):
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == n:
                return [h.getsockname()[1] for h in held]
        raise RuntimeError(f"no {n} free ports below {first_ephemeral}")
    finally:
        for h in held:
            h.close()


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port the OS chose, to hand to a server in this process (uvicorn's
    ``serve(sockets=...)``): the port is never free between choosing and serving."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


def listening_port(proc: subprocess.Popen) -> tuple[int, str]:
    """The port of a ``dsv41.serve --port 0`` started with its stderr on a text stdout pipe, read
    from its "listening on" line (it binds before it starts the engine, and says where once it
    serves); (port, the lines before). Raises with its output if it exits first."""
    lines = []
    while True:
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            raise RuntimeError(f"server exited ({proc.returncode}) before it listened: {''.join(lines)}")
        if m := LISTENING.search(line):
            return int(m.group(1)), "".join(lines) + line
        lines.append(line)


def start_scheduler(folder, env=None, timeout_s: float = 120, **popen) -> tuple[subprocess.Popen, str]:
    """A ``dask scheduler`` on a port the OS chose, its address read from the scheduler file it
    writes in folder; (process, address). The caller stops it by PID."""
    info = folder / "scheduler.json"
    proc = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                             "--port", "0", "--no-dashboard", "--scheduler-file", str(info)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return proc, json.loads(info.read_text())["address"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError):      # not (all) written yet
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the dask scheduler did not start (status {proc.poll()})")
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
