"""Helpers of the tests that start processes."""
import os
import signal
import subprocess
import time


def as_a_terminal_starts_it() -> None:
    """``preexec_fn`` of a command that a test stops as a terminal would (Ctrl-C to its group):
    SIGINT and SIGTERM at their defaults and unblocked, as a shell starts a foreground command,
    whatever this pytest process inherited. A pytest started as a background job of a
    non-interactive shell (``pytest &``, nohup) has SIGINT ignored, exec keeps that, and the
    command's Python then never turns SIGINT into KeyboardInterrupt: it ran on and exited 0."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def still_running(session: int, wait_s: float = 5.0) -> list[str]:
    """Processes of the session still running (zombies aside: their parent is gone and init reaps them)."""
    deadline = time.monotonic() + wait_s
    while True:
        ps = subprocess.run(["ps", "-s", str(session), "-o", "pid=,stat=,args="], capture_output=True, text=True)
        alive = [line for line in ps.stdout.splitlines() if line.split()[1][0] != "Z"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def signal_and_wait(p: subprocess.Popen, signum: int, group: bool = True) -> tuple[float, str, list[str]]:
    """Send signum to p's whole process group (as a terminal's Ctrl-C) or to p alone (as `kill PID`)
    and wait for p: (seconds from the signal to its exit, the rest of its stderr, processes left)."""
    if group:
        os.killpg(p.pid, signum)
    else:
        p.send_signal(signum)
    t0 = time.monotonic()
    p.wait(60)
    elapsed = time.monotonic() - t0
    return elapsed, p.stderr.read(), still_running(p.pid)
