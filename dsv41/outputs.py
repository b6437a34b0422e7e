"""Every file a command writes (trace outputs, graphs, check dumps, checkpoint files), written so that a
link planted at its path is never followed.

Someone who can write the output folder could point ``NAME`` at any file the user may write (a symlink,
or a hard link to a file on the same disk); opening it plainly would overwrite that file with the
command's output. So a file is written as a temporary file beside it, created exclusively
(``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing file, never through a link), and renamed over
``NAME`` when complete: a rename replaces the directory entry, so whatever ``NAME`` was, its target is
untouched, and a failed write (a full disk) leaves the old file or none, never half of one. The folder
is opened once without following a link (a symlinked folder is refused) and every step works relative
to that handle, so the folder cannot be swapped for a link mid-write. A symlink already at ``NAME`` is
refused (``ELOOP``) so that the user hears of it; one planted after that check is replaced, never
followed. Callers report the OSError as one line.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_folder(path) -> int:
    """A handle on ``path`` as a real folder: a symlink raises OSError(ELOOP), a file ENOTDIR."""
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as e:
        _refuse_symlink(e, path)
        raise


def _refuse_symlink(e: OSError, path) -> None:
    """OSError(ELOOP) naming ``path`` when opening it as a folder failed because it is a symlink
    (O_DIRECTORY | O_NOFOLLOW on one: ENOTDIR on Linux, ELOOP elsewhere)."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
        raise OSError(errno.ELOOP, "is a symbolic link; nothing is written through a link", str(path)) from None


def open_path(path, make: bool = False) -> int:
    """A handle on the folder ``path`` reached one component at a time from ``/``, each opened with
    ``O_NOFOLLOW | O_DIRECTORY`` relative to the one before, so no component of it is a link (a symlink
    anywhere on the way raises OSError(ELOOP) naming it); make: missing folders are made on the way,
    each relative to the handle above it."""
    path = os.path.abspath(path)
    fd = os.open("/", _DIR_FLAGS)
    at = "/"
    try:
        for part in Path(path).parts[1:]:
            at = os.path.join(at, part)
            unmade = None
            if make:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as e:     # said below if the folder is not there to open
                    unmade = e
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                _refuse_symlink(e, at)
                why = unmade or e
                raise OSError(why.errno, why.strerror, at) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def refuse_link(name: str, folder: int, shown) -> None:
    """OSError(ELOOP) when ``name`` in the open ``folder`` is a symlink (``shown`` names it)."""
    try:
        mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, "is a symbolic link; a plain file is written there, never through a link",
                      str(shown))


class Output:
    """``with open_output(path) as f``: ``f`` writes a temporary file beside ``path``, renamed over it when
    the block ends without an exception and removed otherwise."""

    def __init__(self, path, binary: bool, mode: int, dir_fd: int | None):
        path = Path(path)
        self.name = path.name
        # a folder handle of the caller's is borrowed (a duplicate of it closed here)
        self.folder = open_folder(path.parent) if dir_fd is None else os.dup(dir_fd)
        try:
            refuse_link(self.name, self.folder, path)
            self.tmp = f".{self.name}.{secrets.token_hex(6)}.tmp"
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=self.folder)
        except BaseException:
            os.close(self.folder)
            raise
        self.file = os.fdopen(fd, "wb" if binary else "w")

    def __enter__(self):
        return self.file

    def __exit__(self, kind, value, tb) -> None:
        try:
            self.file.close()       # the last buffered bytes: a full disk fails here too
            if kind is None:
                os.replace(self.tmp, self.name, src_dir_fd=self.folder, dst_dir_fd=self.folder)
        except BaseException:
            self._discard()
            raise
        else:
            if kind is not None:
                self._discard()
        finally:
            os.close(self.folder)

    def _discard(self) -> None:
        try:
            os.unlink(self.tmp, dir_fd=self.folder)
        except OSError:
            pass


def open_output(path, binary: bool = False, mode: int = 0o644, dir_fd: int | None = None) -> Output:
    """``path`` written as a plain file (see the module's docstring); a symlink at it, or a symlinked or
    missing folder, raises OSError before anything is written. dir_fd: ``path`` is a name in the folder
    this handle holds open (as for ``os.open``), so the file lands there whatever its path now leads to."""
    return Output(path, binary, mode, dir_fd)


def write_output(path, data: str | bytes, mode: int = 0o644, dir_fd: int | None = None) -> None:
    with open_output(path, isinstance(data, bytes), mode, dir_fd) as f:
        f.write(data)


def open_append(path):
    """``path`` opened to append bytes (a log, a lock), created if missing, in a real folder; a symlink
    at it raises OSError(ELOOP). Appending never truncates, so there is nothing to rename."""
    path = Path(path)
    folder = open_folder(path.parent)
    try:
        fd = os.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=folder)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; nothing is appended through a link", str(path)) from None
        raise
    finally:
        os.close(folder)
    return os.fdopen(fd, "ab", buffering=0)
