"""Every file a command writes never goes through a link planted at its path, and the checkpoint writer
leaves a whole checkpoint or nothing (issue 49, items 1 and 5).

The writer refuses a folder that already holds anything (a link planted there among it) with one line;
trace, graph and report files are refused up front when a symlink is at their path, and one planted
after that check is replaced by a plain file (``dsv41.outputs``): either way the link's target keeps
its bytes."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv41.checkpoint import writer
from dsv41.checkpoint.headers import INDEX
from dsv41.checkpoint.reader import open_checkpoint
from dsv41.checkpoint.text import TOKENIZER, TOKENIZER_CONFIG
from dsv41.cli import write_checkpoint as cli
from dsv41.config import TINY
from dsv41.graph.export import write_graph
from dsv41.outputs import open_output, write_output
from dsv41.plan.sizing import checkpoint_bytes
from dsv41.telemetry.export import write_traces
from processes import as_a_terminal_starts_it

REPO = Path(__file__).resolve().parents[1]
ERROR = "python -m dsv41.checkpoint.write: error: "
SMALL = ["--layers", "2", "--shard-mb", "0.5"]       # several shards, written in a few seconds
SHARD = "model-00001-of-00004.safetensors"


def _refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), err        # no usage block before it
    return lines[0][len(ERROR):]


def _victim(tmp_path) -> tuple[Path, bytes]:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep these bytes\n")
    return victim, victim.read_bytes()


def _left(tmp_path) -> set[str]:
    return {p.name for p in tmp_path.iterdir()}


def test_the_writer_writes_shards_that_the_reader_opens(tmp_path, capsys):
    assert cli.main([str(tmp_path / "ck"), *SMALL]) == 0
    files = {p.name for p in (tmp_path / "ck").iterdir()}
    assert {INDEX, "config.json", TOKENIZER, TOKENIZER_CONFIG, SHARD} <= files, files
    assert set(json.loads((tmp_path / "ck" / INDEX).read_text())["weight_map"].values()) == \
        {f for f in files if f.endswith(".safetensors")}
    open_checkpoint(tmp_path / "ck")
    assert _left(tmp_path) == {"ck"}            # the work folder went into place, nothing beside it


# ---- item 1: a link at any path the writer, --trace, --show-graph or --report write ---------------------

@pytest.mark.parametrize("name", ["config.json", INDEX, SHARD, TOKENIZER, TOKENIZER_CONFIG])
def test_a_symlink_at_any_checkpoint_file_leaves_its_target_byte_identical(tmp_path, capsys, monkeypatch, name):
    victim, kept = _victim(tmp_path)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / name).symlink_to(victim)
    line = _refused(capsys, [str(folder), *SMALL])
    assert line == f"path: cannot write {folder}: is not empty; give a new or empty folder (nothing is written over)"
    assert victim.read_bytes() == kept and os.readlink(folder / name) == str(victim)

    # planted while the writer works (after its check): the files go to a folder of the writer's own,
    # and the rename onto a folder that is no longer empty fails
    folder.joinpath(name).unlink()
    folder.rmdir()
    draw = writer.draw_checkpoint

    def planting(cfg, seed):
        folder.mkdir()
        (folder / name).symlink_to(victim)
        yield from draw(cfg, seed)

    monkeypatch.setattr(writer, "draw_checkpoint", planting)
    line = _refused(capsys, [str(folder), *SMALL])
    assert line.startswith(f"path: cannot write {folder}: "), line
    assert victim.read_bytes() == kept and os.listdir(folder) == [name]
    assert _left(tmp_path) == {"victim", "ck"}      # the work folder removed


def test_a_symlinked_output_folder_is_refused(tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "ck").symlink_to(real)
    line = _refused(capsys, [str(tmp_path / "ck"), *SMALL])
    assert line == (f"path: cannot write {tmp_path / 'ck'}: is a symbolic link; give a real folder "
                    "(the writer never writes through a link)")
    assert os.listdir(real) == []


class _Graph:
    def to_dot(self) -> str:
        return "digraph g { a -> b }\n"


def _write_run_outputs(traces: Path) -> list[Path]:
    """Every file --trace, --show-graph and --report write, written by the functions the run calls."""
    out = write_traces("x", [], {}, traces)
    write_graph(_Graph(), str(traces / "g.dot"))
    write_output(traces / "run.dask-report.html", b"<html></html>")
    return [Path(out["otlp"]), Path(out["perfetto"]), traces / "g.dot", traces / "run.dask-report.html"]


@pytest.mark.parametrize("name", ["x.otlp.jsonl", "x.perfetto.json", "g.dot", "run.dask-report.html"])
def test_trace_graph_and_report_files_never_write_through_a_link(tmp_path, name):
    victim, kept = _victim(tmp_path)
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / name).symlink_to(victim)          # found at the write: refused, nothing written
    with pytest.raises(OSError) as e:
        _write_run_outputs(traces)
    assert e.value.errno == errno.ELOOP
    assert victim.read_bytes() == kept and os.readlink(traces / name) == str(victim)
    assert not [p for p in os.listdir(traces) if p.endswith(".tmp")]

    (traces / name).unlink()                    # a hard link: replaced by the new file, never written into
    os.link(victim, traces / name)
    written = _write_run_outputs(traces)
    assert victim.read_bytes() == kept
    assert all(p.is_file() and not p.is_symlink() and p.stat().st_nlink == 1 for p in written)


def test_a_symlinked_traces_folder_is_refused_before_and_at_the_write(tmp_path, capsys, monkeypatch):
    from dsv41.cli import run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "traces").symlink_to(elsewhere)
    with pytest.raises(OSError) as e:
        _write_run_outputs(tmp_path / "traces")
    assert e.value.errno == errno.ELOOP
    assert os.listdir(elsewhere) == []
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        run.main(["--trace", "x"])
    assert capsys.readouterr().err.strip() == (
        f"python -m dsv41.run: error: --trace: {tmp_path / 'traces'} is a symbolic link; outputs are written "
        "only into a real folder, never through a link")


def test_a_failed_output_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with open_output(path) as f:
            f.write("half")
            raise RuntimeError("the disk filled")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


# ---- item 5: the writer's gaps --------------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["--shard-mb", "nan"], "--shard-mb: must be in (0, 100000] MB, got nan"),
    (["--shard-mb", "-1"], "--shard-mb: must be in (0, 100000] MB, got -1"),
    (["--seed", "-5"], "--seed: must be in [0, 4294967295], got -5"),
    (["--seed", str(10 ** 30)], f"--seed: must be in [0, 4294967295], got {10 ** 30}"),
    (["--layers", "0"], "--layers: must be in [1, "),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_writer_values_are_one_line_without_usage(tmp_path, capsys, argv, words):
    line = _refused(capsys, [str(tmp_path / "ck"), *argv])
    assert line.startswith(words), line
    assert _left(tmp_path) == set()


def test_an_empty_path_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _refused(capsys, [""]) == "path: is empty; give the folder to write"
    assert _left(tmp_path) == set()


def test_a_disk_filling_mid_write_leaves_nothing_that_looks_like_a_checkpoint(tmp_path, capsys, monkeypatch):
    draw = writer.draw_checkpoint

    def filling(cfg, seed):     # the disk fills after a few shards were written
        for i, pair in enumerate(draw(cfg, seed)):
            if i == 40:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            yield pair

    monkeypatch.setattr(writer, "draw_checkpoint", filling)
    line = _refused(capsys, [str(tmp_path / "ck"), "--shard-mb", "0.05"])
    assert line == f"path: cannot write {tmp_path / 'ck'}: No space left on device"
    assert _left(tmp_path) == set()


def test_the_free_space_line_gives_sizes_that_can_be_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 40, used=0, free=12_345))
    need = checkpoint_bytes(TINY)
    line = _refused(capsys, [str(tmp_path / "ck")])
    assert line.startswith(f"--config: tiny is {need / 1e6:.3g} MB of tensors and the disk has 12.3 kB free; "), line
    assert _left(tmp_path) == set()


def _without_dac_override():
    """Root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH, so that a folder's mode bits hold for it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0):        # PR_CAPBSET_DROP: gone from the exec'd process
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.timeout(300)
def test_a_read_only_output_folder_is_one_line(tmp_path):
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"dsv41-ro-{os.getpid()}"   # traversable without root's override
    folder = base / "ro"
    folder.mkdir(parents=True)
    try:
        folder.chmod(0o555)
        r = subprocess.run([sys.executable, "-m", "dsv41.checkpoint.write", str(folder), *SMALL], capture_output=True,
                           text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                           preexec_fn=_without_dac_override if os.geteuid() == 0 else None)
        assert r.returncode == 2 and r.stderr == f"{ERROR}path: cannot write {folder}: is not writable\n", r.stderr
        assert os.listdir(folder) == [] and os.listdir(base) == ["ro"]
    finally:
        folder.chmod(0o755)
        folder.rmdir()
        base.rmdir()


# ---- issue 60, items 4 and 7: folders swapped mid-run, and SIGTERM mid-write ----------------------------

WRITTEN_NAMES = ["model-00001.safetensors", "model-00001-of-00004.safetensors", "config.json", INDEX, TOKENIZER,
                 TOKENIZER_CONFIG]


def _snapshot(root: Path) -> dict:
    """Every entry under ``root`` (links not followed): its bytes, a link's target, or a folder mark."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else p.read_bytes()
    return out


def _victim_folder(tmp_path) -> Path:
    """A folder of files named as the writer names its own, each holding bytes of its own."""
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in WRITTEN_NAMES:
        (victim / name).write_bytes(f"{name}: keep these bytes\n".encode())
    return victim


def _swap_after(monkeypatch, when: str, swap) -> None:
    """Run ``swap()`` once the writer has written its first file ("first": a shard) or its last
    ("last": tokenizer_config.json, just before it puts the folder in place)."""
    real, done = writer.write_output, []

    def writing(name, *args, **kwargs):
        real(name, *args, **kwargs)
        if not done and (when == "first" or Path(name).name == TOKENIZER_CONFIG):
            done.append(name)
            swap()

    monkeypatch.setattr(writer, "write_output", writing)


def _work(parent: Path) -> Path:
    return next(p for p in parent.iterdir() if p.name.startswith(".ck.partial-"))


def _no_checkpoint_anywhere(root: Path) -> None:
    """No ``ck``, and no index outside the victim folder (whose bytes the snapshot checks)."""
    for dirpath, dirs, files in os.walk(root):      # links are not followed
        assert "ck" not in dirs + files, (dirpath, dirs, files)
        assert INDEX not in files or Path(dirpath).name == "victim", (dirpath, files)


@pytest.mark.parametrize("when", ["first", "last"])
def test_the_work_folder_swapped_for_a_link_mid_run_writes_nothing_through_it(tmp_path, capsys, monkeypatch, when):
    victim = _victim_folder(tmp_path)
    kept = _snapshot(victim)
    parent = tmp_path / "out"
    parent.mkdir()

    def swap():     # the writer's own folder moved aside, a link to the victim in its place
        work = _work(parent)
        work.rename(tmp_path / "moved")
        work.symlink_to(victim, target_is_directory=True)

    _swap_after(monkeypatch, when, swap)
    line = _refused(capsys, [str(parent / "ck"), *SMALL])
    assert line.startswith(f"path: cannot write {parent / 'ck'}: the work folder {parent}/.ck.partial-") and \
        line.endswith("was replaced (by a link or another folder) while the checkpoint was written; "
                      "nothing was put in place"), line
    assert _snapshot(victim) == kept
    assert os.listdir(tmp_path / "moved") == []       # what it wrote there removed, through its handle
    assert [p.is_symlink() for p in parent.iterdir()] == [True]     # the planted link alone, as planted
    _no_checkpoint_anywhere(tmp_path)


@pytest.mark.parametrize("swap_for", ["a link to where it was moved", "a link to a victim folder", "another folder"])
def test_the_parent_folder_swapped_mid_run_is_refused(tmp_path, capsys, monkeypatch, swap_for):
    victim = _victim_folder(tmp_path)
    kept = _snapshot(victim)
    parent, moved = tmp_path / "out", tmp_path / "moved"
    parent.mkdir()

    def swap():
        parent.rename(moved)
        if swap_for == "another folder":
            parent.mkdir()
        else:
            parent.symlink_to(moved if swap_for.endswith("moved") else victim, target_is_directory=True)

    _swap_after(monkeypatch, "last", swap)
    line = _refused(capsys, [str(parent / "ck"), *SMALL])
    why = ("by another folder" if swap_for == "another folder"
           else f"while the checkpoint was written ({parent}: is a symbolic link")
    assert line.startswith(f"path: cannot write {parent / 'ck'}: {parent} was replaced {why}") and \
        line.endswith("nothing was put in place"), line
    assert _snapshot(victim) == kept
    assert os.listdir(moved) == []          # the work folder removed from where its parent went
    if swap_for == "another folder":
        assert os.listdir(parent) == []
    _no_checkpoint_anywhere(tmp_path)


def test_a_symlink_among_the_parents_is_refused(tmp_path, capsys):
    victim = _victim_folder(tmp_path)
    kept = _snapshot(victim)
    (tmp_path / "via").symlink_to(victim, target_is_directory=True)
    line = _refused(capsys, [str(tmp_path / "via" / "sub" / "ck"), *SMALL])
    assert line == f"path: cannot write {tmp_path / 'via'}: is a symbolic link; nothing is written through a link"
    assert _snapshot(victim) == kept


# the writer's command, paused (blocked reading its stdin) once its first shard is written
PAUSED_WRITER = """
import sys
from pathlib import Path
from dsv41.checkpoint import writer
from dsv41.cli.write_checkpoint import main

real = writer.write_output

def writing(name, *args, **kwargs):
    real(name, *args, **kwargs)
    if Path(name).name.startswith("model-"):
        print("shard written", flush=True)
        sys.stdin.read()

writer.write_output = writing
raise SystemExit(main())
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum,status,word", [
    (signal.SIGTERM, 143, "terminated"),
    pytest.param(signal.SIGINT, 130, "interrupted", marks=pytest.mark.slow)])     # SIGINT was clean before
def test_a_signal_mid_write_leaves_nothing(tmp_path, signum, status, word):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", PAUSED_WRITER, str(out / "ck"), *SMALL], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=as_a_terminal_starts_it)
    try:
        assert p.stdout.readline() == "shard written\n", p.stderr.read()
        assert [q.name for q in out.iterdir()][0].startswith(".ck.partial-")      # mid-write: the work is there
        p.send_signal(signum)
        p.wait(120)
        assert (p.returncode, p.stderr.read()) == (status, f"python -m dsv41.checkpoint.write: {word}\n")
        assert os.listdir(out) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ---- issue 60: the PyPTO worker's log and the simulated-times cache's lock, opened to append ------------

def _links(tmp_path, path: Path) -> list[tuple[Path, Path, bytes | None]]:
    """(link, target, target's bytes or None) for a link at ``path`` to an existing victim file, then one
    to a name nobody has made (O_CREAT through it would make that file)."""
    victim, kept = _victim(tmp_path)
    return [(path, victim, kept), (path, tmp_path / "made-through-a-link", None)]


def _unchanged(target: Path, kept: bytes | None) -> None:
    if kept is None:
        assert not os.path.lexists(target)
    else:
        assert target.read_bytes() == kept


def _refusal(call) -> int | None:
    """The errno of the OSError ``call()`` raises (None when it raises none or another error)."""
    try:
        call()
    except OSError as e:
        return e.errno
    except RuntimeError:        # the stand-in worker start: the log was opened
        return None
    return None


def test_the_sim_cache_lock_is_never_opened_through_a_link(tmp_path):
    from dsv41.kernels.pypto.sim import SimCache
    cache = SimCache(tmp_path / "cache" / "sim_times.json")
    for link, target, kept in _links(tmp_path, tmp_path / "cache" / "sim_times.lock"):
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(target)
        refused = _refusal(lambda: cache.put("k", {"us": 1.0, "error": None}))
        _unchanged(target, kept)
        assert refused == errno.ELOOP
        assert not (tmp_path / "cache" / "sim_times.json").exists()     # nothing merged without the lock
        link.unlink()


def test_the_pypto_worker_log_is_never_opened_through_a_link_by_its_starter(tmp_path, monkeypatch):
    from dsv41.kernels.pypto import sim

    def starting(argv, stdout, **kwargs):     # what the worker would print, then no worker at all
        stdout.write(b"worker output\n")
        raise RuntimeError("no worker in this test")

    monkeypatch.setattr(sim.subprocess, "Popen", starting)
    root = tmp_path / "run"
    root.mkdir()
    for link, target, kept in _links(tmp_path, root / "worker-sim.log"):
        link.symlink_to(target)
        refused = _refusal(lambda: sim.PyptoWorker("sim", root)._start())
        _unchanged(target, kept)
        assert refused == errno.ELOOP
        link.unlink()


@pytest.mark.timeout(300)
def test_the_pypto_worker_never_logs_through_a_link(tmp_path):
    """The worker itself reopens its log for fds 1 and 2: a link there is refused before either points at it."""
    root = tmp_path / "run"
    root.mkdir()
    for link, target, kept in _links(tmp_path, root / "worker-sim.log"):
        link.symlink_to(target)
        r = subprocess.run([sys.executable, "-c", f"from dsv41.kernels.pypto import worker; "
                            f"worker.main(None, 'sim', {str(root)!r})"], capture_output=True, text=True, timeout=240,
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL)
        _unchanged(target, kept)
        assert r.returncode == 1 and "is a symbolic link" in r.stderr, r.stderr[-2000:]
        link.unlink()
