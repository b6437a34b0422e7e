"""Faults around a run, as a careful user or a hostile tester meets them (issue 18, the runtime half):
every input failure is one line naming the flag and the file, exit status 2, before any work; a peer
that is not a dask scheduler is named within --connect-timeout; a dead collector costs seconds, one
warning line; Ctrl-C and SIGTERM end a distributed run within 5 s, one line, nothing left behind."""
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from processes import as_a_terminal_starts_it, signal_and_wait

from dsv41.cli import run
from dsv41.cli import args as rules

REPO = Path(__file__).resolve().parents[1]
PROG = "python -m dsv41.run: error: "


def _one_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        run.main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture
def text_checkpoint(tmp_path, tiny_checkpoint):
    """What is read before the run starts (config and tokenizer files) of the TINY checkpoint, in a
    folder of the test's own, so a file can be spoiled."""
    folder = tmp_path / "ck"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_checkpoint / name).exists():
            shutil.copy(tiny_checkpoint / name, folder / name)
    return folder


def _with_template(folder: Path, template: str) -> None:
    path = folder / "tokenizer_config.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc["chat_template"] = template
    path.write_text(json.dumps(doc))


# ---- input files: one line naming the flag and the file ------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("content,words", [
    (b"good line\n\xff\xfe bad bytes\n", ["expected UTF-8 text, found byte 0xff at offset 10"]),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", ["expected UTF-8 text, found binary data (a NUL byte at offset 7)"]),
], ids=["invalid-utf8", "binary"])
def test_a_prompt_file_that_is_not_text_is_blamed(capsys, monkeypatch, tmp_path, text_checkpoint, content, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_bytes(content)
    msg = _one_line(capsys, ["--checkpoint", str(text_checkpoint), "--prompt-file", "p.txt"])
    assert msg.startswith(PROG + "--prompt-file: p.txt: "), msg
    assert all(w in msg for w in words), msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("template,words", [
    ("{% for m in messages %}{{ m.content }", ["TemplateSyntaxError", "(line 1)"]),
    ("{{ raise_exception('only system and user roles') }}", ["raise_exception"]),
    ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", ["nosuchfilter"]),
], ids=["syntax", "raise_exception", "unknown-filter"])
def test_a_broken_chat_template_is_one_line(capsys, monkeypatch, tmp_path, text_checkpoint, template, words):
    monkeypatch.chdir(tmp_path)
    _with_template(text_checkpoint, template)
    msg = _one_line(capsys, ["--checkpoint", str(text_checkpoint), "--prompt", "hi", "--chat"])
    assert msg.startswith(PROG + f"--chat: {text_checkpoint / 'tokenizer_config.json'}: chat_template"), msg
    assert all(w in msg for w in words), msg


@pytest.mark.timeout(120)
def test_debug_shows_the_template_traceback(monkeypatch, tmp_path, text_checkpoint):
    from jinja2 import TemplateError
    monkeypatch.chdir(tmp_path)
    _with_template(text_checkpoint, "{{ raise_exception('no') }}")
    with pytest.raises(rules.UsageError) as e:
        run.main(["--checkpoint", str(text_checkpoint), "--prompt", "hi", "--chat", "--debug"])
    assert isinstance(e.value.__cause__.__cause__, TemplateError)   # the template's own error, kept


@pytest.mark.timeout(120)
def test_an_unreadable_config_is_one_line(capsys, monkeypatch, tmp_path, text_checkpoint):
    """Simulated: the test runs as root, which reads any file, so Path.read_text raises what a
    non-root user gets on a 0o000 config.json (test_an_unreadable_config_as_another_user does it for real)."""
    monkeypatch.chdir(tmp_path)
    config = text_checkpoint / "config.json"
    read_text = Path.read_text

    def denied(self, *a, **k):
        if self == config:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    msg = _one_line(capsys, ["--checkpoint", str(text_checkpoint)])
    assert msg == PROG + f"--checkpoint: {config}: cannot read (Permission denied)"


def _non_root() -> list[str] | None:
    """A command prefix that runs as an unprivileged user, where the test runs as root."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.timeout(120)
def test_an_unreadable_config_as_another_user(tmp_path, text_checkpoint):
    prefix = _non_root()
    if prefix is None:
        pytest.skip("needs root (to become another user) and setpriv")
    folder = Path(tempfile.mkdtemp(prefix="dsv41-unreadable-"))   # where nobody can reach it
    try:
        for f in text_checkpoint.iterdir():
            shutil.copy(f, folder / f.name)
        os.chmod(folder, 0o755)
        os.chmod(folder / "config.json", 0o000)
        r = subprocess.run([*prefix, sys.executable, "-m", "dsv41.run", "--checkpoint", str(folder)],
                           capture_output=True, text=True, timeout=100, cwd="/", stdin=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"})
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == PROG + f"--checkpoint: {folder / 'config.json'}: cannot read (Permission denied)"
    finally:
        shutil.rmtree(folder)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,expected", [
    (["--checkpoint", ""], "--checkpoint: got an empty path; expected a checkpoint folder"),
    (["--checkpoint", "", "--prompt", "hi"], "--checkpoint: got an empty path; expected a checkpoint folder"),
    (["--executor", "distributed", "--address", "tcp://h:99999"],
     "--address: port 99999 out of range [1, 65535]; expected e.g. tcp://127.0.0.1:8786"),
    (["--executor", "distributed", "--address", "http://127.0.0.1:8787"],
     "--address: http:// is not a dask scheduler address (a dashboard's, perhaps); the scheduler listens on "
     "tcp://, expected e.g. tcp://127.0.0.1:8786"),
], ids=["empty-checkpoint", "empty-checkpoint-with-prompt", "port-range", "http-address"])
def test_refused_at_once(capsys, monkeypatch, tmp_path, argv, expected):
    monkeypatch.chdir(tmp_path)
    tried = []

    def connect(sock, address):
        tried.append(address)
        raise ConnectionRefusedError(address)
    monkeypatch.setattr(socket.socket, "connect", connect)
    assert _one_line(capsys, argv) == PROG + expected
    assert tried == []                        # no connection is tried
    assert list(tmp_path.iterdir()) == []


# ---- output files checked before the run --------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,blocked", [
    (["--trace", "x"], "x.perfetto.json"),
    (["--trace", "x"], "x.otlp.jsonl"),
    (["--show-graph", "g.dot"], "g.dot"),
    (["--plan", "--trace", "p"], "p.perfetto.json"),
    (["--executor", "distributed", "--report"], "run.dask-report.html"),
])
def test_an_output_file_that_cannot_be_written_is_refused_up_front(capsys, monkeypatch, tmp_path, argv, blocked):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces" / blocked).mkdir(parents=True)
    msg = _one_line(capsys, argv)
    assert msg.endswith(f"traces/{blocked} is a folder; the run writes a file there"), msg
    assert msg.startswith(PROG + argv[-2 if argv[-1] != "--report" else -1]), msg
    assert [p.name for p in (tmp_path / "traces").iterdir()] == [blocked]     # nothing else written


@pytest.mark.timeout(120)
def test_an_output_file_without_write_permission_is_refused(capsys, monkeypatch, tmp_path):
    """os.access stands in for a non-root user's view of a read-only file (root may write any file)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces").mkdir()
    target = tmp_path / "traces" / "x.otlp.jsonl"
    target.write_text("")
    access = os.access
    monkeypatch.setattr(rules.os, "access", lambda p, mode: False if Path(p) == Path("traces/x.otlp.jsonl")
                        else access(p, mode))
    assert _one_line(capsys, ["--trace", "x"]) == PROG + "--trace: cannot write traces/x.otlp.jsonl: permission denied"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["localhost:4318", "ftp://collector:4318", "http://:4318", "http://h:99999"])
def test_a_malformed_collector_address_is_refused(capsys, monkeypatch, tmp_path, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", value)
    assert _one_line(capsys, []) == PROG + ("OTEL_EXPORTER_OTLP_ENDPOINT: expected the collector's OTLP/HTTP URL, "
                                            f"e.g. http://localhost:4318, got {value!r}")


# ---- a peer that is not a dask scheduler --------------------------------------------------------------

class _Silent:
    """A TCP listener that accepts and never says a word."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]

    def close(self):
        self.sock.close()


class _Http:
    """A plain HTTP server (the standard library's), in a thread."""

    def __init__(self):
        class Quiet(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _cli(*argv, env=None, cwd=None):
    return subprocess.Popen([sys.executable, "-m", "dsv41.run", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=cwd,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=as_a_terminal_starts_it)


def _kill(p: subprocess.Popen) -> None:
    """The process and whatever it started (its own session), if still there."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer", [_Silent, _Http], ids=["silent-listener", "http-server"])
def test_a_peer_that_is_not_a_scheduler_is_named_within_the_deadline(tmp_path, peer):
    server = peer()
    p = _cli("--executor", "distributed", "--json", "--address", f"tcp://127.0.0.1:{server.port}",
             "--connect-timeout", "3", cwd=tmp_path)
    try:
        header = p.stderr.readline()      # printed once the arguments are checked: the connection starts
        assert header.startswith("dsv41 decode:"), header
        rest = p.stderr.read()            # the peer never answers: only the run's own deadline ends this
        p.wait(30)
    finally:
        _kill(p)
        server.close()
    assert p.returncode == 2, rest
    assert rest.strip() == (PROG + f"--address tcp://127.0.0.1:{server.port}: no answer to dask's handshake "
                            "within 3 s: not a dask scheduler, or a stuck one"), rest
    assert p.stdout.read() == "" and list(tmp_path.iterdir()) == []


# ---- a collector that is down or silent ---------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]     # closed again when the test uses it: nobody listens


def _after_last_step(p: subprocess.Popen) -> tuple[list[str], float]:
    """The stderr lines of a --json run and the seconds from its last step's line to its exit."""
    lines, last = [], None
    for line in p.stderr:
        lines.append(line.rstrip("\n"))
        if line.rstrip().endswith("ms") or " ms " in line:
            last = time.monotonic()
    p.wait(60)
    return lines, time.monotonic() - last


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("down", ["closed-port", "silent"])
def test_a_dead_collector_costs_seconds_and_one_line(tmp_path, down):
    silent = _Silent() if down == "silent" else None
    port = silent.port if silent else _closed_port()
    p = _cli("--graph", "prefill", "--json", cwd=tmp_path, env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"})
    try:
        lines, tail = _after_last_step(p)
        out = p.stdout.read()
    finally:
        _kill(p)
        if silent:
            silent.close()
    assert p.returncode == 0, lines
    assert json.loads(out)["tokens"]
    # before: 40.6 s (closed port) with 29 lines of retries and "shutdown can only be called once"
    assert tail < 12, tail    # the span exporter's 2 s and the metrics exporter's 2 s, and a loaded machine
    warnings = [line for line in lines if not (line.startswith(("dsv41 prefill:", "  built in")) or " ms" in line)]
    assert len(warnings) == 1, lines
    assert warnings[0].startswith("python -m dsv41.run: warning: ") and "span(s) not delivered to the OTLP " \
        f"collector at http://127.0.0.1:{port}" in warnings[0], warnings
    assert int(warnings[0].split(": warning: ")[1].split()[0]) > 0


# ---- Ctrl-C and SIGTERM on a distributed run ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum,status,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_a_distributed_run_quickly_and_cleanly(tmp_path, signum, status, word):
    temp = tmp_path / "tmp"         # the run's TMPDIR: dask's scratch space and semaphores go there
    temp.mkdir()
    p = _cli("--executor", "distributed", "--json", "--tp", "1", "--dp", "2", "--new-tokens", "200", cwd=tmp_path,
             env={"TMPDIR": str(temp)})
    try:
        before = []
        for line in p.stderr:        # the cluster is up and a step ran: the next ones are under way
            before.append(line)
            if line.startswith("  prefill "):
                break
        assert before and before[-1].startswith("  prefill "), before
        time.sleep(1)
        rest, left = signal_and_wait(p, signum)    # the whole group, as a terminal sends Ctrl-C
    finally:
        _kill(p)
    assert p.returncode == status, rest
    assert rest == f"python -m dsv41.run: {word}\n", rest   # no worker tracebacks, no leaked-semaphore warning
    assert left == []
    assert list(temp.rglob("*")) == []


# ---- issue 49: stdout closed, Ctrl-C while loading, a second Ctrl-C while leaving ---------------------

def _command(*argv, module="dsv41.run", env=None, preexec_fn=None, timeout=240):
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=preexec_fn is None, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO,
                          stdin=subprocess.DEVNULL, timeout=timeout, preexec_fn=preexec_fn,
                          **({} if preexec_fn is None else {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}))


@pytest.mark.timeout(300)
def test_a_json_run_with_stdout_closed_does_not_exit_0_silently():
    """``>&-``: the answer had nowhere to go and the run said nothing, exit 0."""
    r = _command("--executor", "reference", "--json", "--new-tokens", "1", preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and r.stderr == (
        f"{PROG}stdout is closed; the run's answer has nowhere to go (redirect it, e.g. to a file)\n"), r.stderr


# An import hook that sends this process SIGINT as it starts importing one module: Ctrl-C at exactly that
# point of the start-up, whatever the machine's speed.
SITECUSTOMIZE = '''
import os, signal, sys
class _Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["DSV41_TEST_INTERRUPT_AT"]:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, _Interrupt())
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize("module,at", [("dsv41.run", "torch"), ("dsv41.run", "dsv41.cli.run"),
                                       ("dsv41.serve", "dsv41.cli.serve"),
                                       ("dsv41.checkpoint.write", "dsv41.cli.write_checkpoint")])
def test_ctrl_c_while_a_command_loads_is_one_line_and_status_130(tmp_path, module, at):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    r = _command(str(tmp_path / "ck") if module == "dsv41.checkpoint.write" else "--executor", "reference",
                 module=module, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "DSV41_TEST_INTERRUPT_AT": at})
    assert r.returncode == 130 and r.stderr == f"python -m {module}: interrupted\n", r.stderr
    assert r.stdout == ""


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_while_leaving_adds_no_atexit_traceback():
    """The first Ctrl-C ends the run (``exit_now``); a second one lands in an atexit handler (a
    distributed start-up being torn down): the process leaves at once, with the first one's status."""
    code = ("import atexit, os, signal, time\n"
            "from dsv41.cli.interrupt import exit_now\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(30)))\n"
            "exit_now(130)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 130 and r.stderr == "", r.stderr
