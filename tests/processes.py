"""Helpers of the tests that start processes."""
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
