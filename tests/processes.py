"""Helpers of the tests that start processes."""
import os
import subprocess
import time


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
