"""Files a run writes under ./traces, opened so that a symlink there is never followed.

Someone who can write ./traces could point ``traces/NAME`` at any file the user may write; opening
it plainly would overwrite that file with the run's output. ``O_NOFOLLOW`` makes the open fail
(ELOOP) instead; the command line refuses such a name before the run (``cli.args.outputs_writable``).
"""
from __future__ import annotations

import os


def open_output(path, binary: bool = False):
    """path opened for writing (created or truncated) as a plain file; a symlink raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "wb" if binary else "w")
