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


def still_running(session: int, wait_s: float = 60.0) -> list[str]:
    """Processes of the session still running once wait_s has passed, or none as soon as they have all
    ended (zombies aside: their parent is gone and init reaps them). The wait bounds a process that
    never ends; on a loaded machine one that is ending can take seconds to be scheduled."""
    deadline = time.monotonic() + wait_s
    while True:
        ps = subprocess.run(["ps", "-s", str(session), "-o", "pid=,stat=,args="], capture_output=True, text=True)
        alive = [line for line in ps.stdout.splitlines() if line.split()[1][0] != "Z"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def signal_and_wait(p: subprocess.Popen, signum: int, group: bool = True) -> tuple[str, list[str]]:
    """Send signum to p's whole process group (as a terminal's Ctrl-C) or to p alone (as `kill PID`)
    and wait for p: (the rest of its stderr, processes left). How long the exit takes is no test's
    measure (a loaded machine stretches it); an exit that hangs raises at the 60 s wait."""
    if group:
        os.killpg(p.pid, signum)
    else:
        p.send_signal(signum)
    p.wait(60)
    return p.stderr.read(), still_running(p.pid)
