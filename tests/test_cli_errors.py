"""Mistaken command lines: every one ends before any work with exit status 2 and one line naming the
flag (argparse's convention), never a traceback; a distributed connection fails within its timeout."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv41.cli import run
from dsv41.cli import args as rules
from dsv41.cli.budget import check_budget
from dsv41.config import TINY
from ports import start_scheduler

REPO = Path(__file__).resolve().parents[1]
PROG = "python -m dsv41.run: error: "

# (command line, the flag the error must start with, words the message must contain)
MATRIX = [
    # values out of range
    ("--batch 1000000", "--batch", ["[1, 16]", "per DP group"]),
    ("--prompt-len 5000", "--prompt-len", ["[1, 4095]", "context limit 4096", "chunks"]),
    ("--max-num-batched-tokens 513", "--max-num-batched-tokens", ["[1, 512]", "per DP group"]),
    ("--max-num-batched-tokens 0", "--max-num-batched-tokens", ["[1, 512]"]),
    ("--max-total-tokens 1", "--max-total-tokens", ["[34, 228]", "one request of 57 tokens", "DP group"]),
    ("--new-tokens 100000", "--new-tokens", ["[0, 4047]"]),
    ("--tp 3", "--tp", ["one of 1, 2, 4"]),
    ("--tp 8", "--tp", ["one of 1, 2, 4", "tiny"]),
    ("--ep 3", "--ep", ["tp x --dp = 4"]),
    ("--dp 0", "--dp", ["one of 1, 2, 4, 8"]),
    ("--dp 3", "--dp", ["one of 1, 2, 4, 8"]),
    ("--seed 99999999999999999999999", "--seed", ["[0, 4294967295]"]),
    ("--batch x", "argument --batch", ["invalid int"]),
    ("--backend pypto-npu", "--backend", ["torch_npu"]),
    ("--executor distributed --address notaurl", "--address", ["not a scheduler address", "tcp://"]),
    ("--executor distributed --connect-timeout 0", "--connect-timeout", ["(0, 600]"]),
    ("--plan --context 0", "--context", ["[6, 4096]"]),
    ("--plan --batch 3", "--batch", ["multiple of --dp 2"]),
    # paths and tools, checked up front
    ("--show-graph /no/such/dir/g.dot", "--show-graph", ["plain file name", "traces/"]),
    ("--show-graph g.png", "--show-graph", [".dot or .svg"]),
    ("--trace nosuch/sub", "--trace", ["plain file name"]),
    ("--trace ../x", "--trace", ["plain file name"]),
    ("--executor distributed --dashboard", "--dashboard", ["stdin is not a terminal", "--hold"]),
    ("--executor distributed --dashboard --hold -1", "--hold", [">= 0"]),
    # flags that do not apply to the chosen mode name both flags
    ("--dashboard", "--dashboard", ["--executor threads", "--executor distributed"]),
    ("--executor threads --dashboard", "--dashboard", ["--executor threads"]),
    ("--hold 5", "--hold", ["--executor threads"]),
    ("--executor distributed --hold 5", "--hold", ["needs --dashboard"]),
    ("--address tcp://127.0.0.1:8786", "--address", ["--executor threads"]),
    ("--executor sync --address tcp://127.0.0.1:8786", "--address", ["--executor sync"]),
    ("--report", "--report", ["--executor threads", "--executor distributed"]),
    ("--plan --executor sync", "--executor", ["--plan", "runs nothing"]),
    ("--plan --report", "--report", ["--plan"]),
    ("--plan --executor reference --tp 4 --dp 2", "--executor", ["--plan"]),
    ("--plan --prompt-len 9", "--prompt-len", ["--plan"]),
    ("--plan --show-graph g.dot", "--show-graph", ["--plan"]),
    ("--executor reference --tp 2", "--tp", ["--executor reference"]),
    ("--executor reference --dp 1", "--dp", ["--executor reference"]),
    ("--executor reference --wiring replicated", "--wiring", ["--executor reference"]),
    ("--executor reference --granularity node", "--granularity", ["--executor reference"]),
    ("--executor reference --backend pypto-sim", "--backend", ["--executor reference"]),
    ("--executor reference --show-graph g.dot", "--show-graph", ["--executor reference"]),
    ("--executor reference --trace t", "--trace", ["--executor reference"]),
    ("--graph prefill --new-tokens 100", "--new-tokens", ["needs --graph decode"]),
    ("--graph prefill --speculative ngram", "--speculative", ["needs --graph decode"]),
    ("--draft-tokens 3", "--draft-tokens", ["needs --speculative"]),
    ("--speculative ngram --draft-tokens 6", "--draft-tokens", ["[1, 5]", "6 rows per request"]),
    ("--speculative ngram --draft-tokens 0", "--draft-tokens", ["[1, 5]"]),
    ("--speculative ngram --ngram-min 0", "--ngram-min", ["must be in [1, 32], got 0"]),
    ("--speculative ngram --ngram-min 3 --ngram-max 2", "--ngram-max", ["must be in [--ngram-min 3, 32], got 2"]),
    ("--speculative ngram --ngram-max 1000000000", "--ngram-max", ["must be in [--ngram-min 1, 32], got 1000000000"]),
    ("--ngram-max 4", "--ngram-max", ["needs --speculative ngram"]),
    ("--plan --acceptance 1.5", "--acceptance", ["[0, 1]"]),
    ("--plan --graph prefill --acceptance 0.5", "--acceptance", ["needs --graph decode"]),
    ("--acceptance 0.5", "--acceptance", ["--plan"]),
    ("--plan --draft-tokens 6", "--draft-tokens", ["[0, 5]"]),
    ("--context 0", "--context", ["[1, 4039]", "drawn history"]),
    ("--context 4040", "--context", ["[1, 4039]", "--prompt-len 48"]),
    ("--dispatch eager", "--dispatch", ["--executor threads", "--plan"]),
    ("--check --executor distributed", "--check", ["--executor distributed", "--executor sync or threads"]),
    ("--check --plan", "--check", ["--plan"]),
    # checkpoint serving: the flags that come with it
    ("--prompt hi", "--prompt", ["needs --checkpoint"]),
    ("--no-verify-checksums", "--no-verify-checksums", ["needs --checkpoint"]),
    ("--prompt-file p.txt", "--prompt-file", ["needs --checkpoint"]),
    ("--chat", "--chat", ["needs --prompt or --prompt-file"]),
    ("--checkpoint ck --config tiny", "--config", ["does not apply with --checkpoint", "config.json"]),
    ("--checkpoint ck --prompt hi --batch 2", "--batch", ["does not apply with --prompt", "number of prompts"]),
    ("--checkpoint ck --prompt hi --prompt-len 9", "--prompt-len", ["does not apply with --prompt"]),
    ("--checkpoint ck --prompt hi --seed 1", "--seed", ["does not apply with --prompt"]),
    ("--plan --checkpoint ck --prompt hi", "--prompt", ["--plan"]),
    ("--checkpoint /no/such/ck", "--checkpoint", ["/no/such/ck", "expected a checkpoint folder, found nothing"]),
    ("--device-profile h200", "--device-profile", ["needs --trace"]),
    # reductions of the model (ModelConfig.reduced): each refused naming its option and the rule
    ("--config flash --layers 0 --plan", "--layers", ["[1, 40]", "prefix"]),
    ("--config flash --experts 5 --plan", "--experts", ["[6, 384]", "top-6"]),
    ("--config flash --experts 12 --plan --tp 4 --dp 2", "--experts", ["multiple of EP = 8"]),
    ("--config flash --engram-rows 1 --plan", "--engram-rows", ["[2, 16000000]", "prime"]),
    ("--checkpoint ck --layers 2", "--layers", ["does not apply with --checkpoint"]),
    ("--config flash --layers 40 --experts 8 --executor threads --tp 4 --dp 2", "--config",
     ["flash-L40-E8 needs at least", "available"]),
    # cost before commitment
    ("--config flash", "--config", ["GB", "available", "--plan --config flash"]),
    ("--config flash --executor reference", "--config", ["GB", "--plan --config flash --tp 1 --dp 1"]),
]


def _error_line(capsys, argv: list[str], started: bool = False) -> str:
    """started: the error comes from reaching the cluster, after the run's header line."""
    with pytest.raises(SystemExit) as exit_:
        run.main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" or (started and captured.out.startswith("dsv41 decode:") and
                                  len(captured.out.splitlines()) == 1), captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("line,flag,words", MATRIX, ids=[m[0] for m in MATRIX])
def test_mistaken_command(capsys, monkeypatch, tmp_path, line, flag, words):
    monkeypatch.chdir(tmp_path)
    msg = _error_line(capsys, line.split())
    assert msg.startswith(PROG + flag + ":"), msg
    for w in words:
        assert w in msg, msg
    assert list(tmp_path.iterdir()) == []       # nothing written: every check runs before any work


def test_checkpoint_flags_are_checked_against_its_config(capsys, monkeypatch, tmp_path, tiny_checkpoint):
    """The folder, the prompt file and the prompts' count and length, before the folder is opened."""
    monkeypatch.chdir(tmp_path)
    ck = str(tiny_checkpoint)
    assert _error_line(capsys, ["--checkpoint", str(tmp_path)]) == (
        PROG + f"--checkpoint: {tmp_path / 'config.json'}: expected the model config, found no file")
    assert _error_line(capsys, ["--checkpoint", ck, "--prompt-file", "none.txt"]) == (
        PROG + "--prompt-file: none.txt: expected a file of prompts (one per line), found nothing")
    msg = _error_line(capsys, ["--checkpoint", ck, "--tp", "1", "--dp", "1"] + ["--prompt", "a"] * 9)
    assert msg.startswith(PROG + "--prompt: must be in [1, 8] requests in total") and "got 9" in msg, msg
    # a prompt longer than a prefill step is fed in chunks; one past the context is refused
    msg = _error_line(capsys, ["--checkpoint", ck, "--tp", "1", "--dp", "1", "--prompt", "word " * 6000])
    assert msg.startswith(PROG + "--prompt: must be in [1, 4095] tokens") and "(--checkpoint's" in msg, msg
    msg = _error_line(capsys, ["--checkpoint", ck, "--prompt", "hi", "--new-tokens", "99999"])
    assert msg.startswith(PROG + "--new-tokens: must be in [0, ") and "prompts of up to" in msg, msg
    a = run.parse_args(["--checkpoint", ck, "--prompt", "The river", "--prompt", "Café"])
    assert a.batch == 2 and a.prompt_len == max(map(len, a.prompt_ids)) and a.codec is not None
    assert check_budget(a, TINY, available=10 ** 6).endswith(f"python -m dsv41.run --plan --checkpoint {ck} "
                                                              "--tp 2 --dp 2")
    assert list(tmp_path.iterdir()) == []


def test_svg_without_graphviz(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rules.shutil, "which", lambda exe: None)
    msg = _error_line(capsys, ["--show-graph", "g.svg"])
    assert msg == PROG + ("--show-graph: an .svg needs graphviz's 'dot' on PATH, which is missing; "
                          "ask for a .dot file instead")


def test_every_flag_has_a_row():
    assert rules.unknown_rows(run.build_parser(), run.APPLIES) == []
    assert {flag for flag, _ in run.FIRST + run.CHECKS} <= set(run.APPLIES)
    from dsv41.cli import serve
    assert rules.unknown_rows(serve.build_parser(), serve.SERVE_APPLIES) == []
    assert {flag for flag, _ in serve.CHECKS} <= set(serve.SERVE_APPLIES)


@pytest.mark.parametrize("line, message", [
    ("--port 70000", "--port: must be in [0, 65535], got 70000"),
    ("--executor reference --max-batch 9", "--max-batch: must be in [1, 8] (8 per DP group on --config tiny)"),
    ("--max-context 1", "--max-context: must be in [2, 4096] tokens on --config tiny, got 1"),
    ("--max-queue -1", "--max-queue: must be in [0, 65536], got -1"),
    ("--max-queue 1000000000", "--max-queue: must be in [0, 65536], got 1000000000"),
    ("--max-body-bytes 99999999999", "--max-body-bytes: must be in [1024, 1073741824], got 99999999999"),
    ("--executor reference --tp 2", "--tp: does not apply with --executor reference"),
    ("--temperature 1", "unrecognized arguments: --temperature"),     # per request, not per server
    ("--speculative ngram --draft-tokens 9", "--draft-tokens: must be in [1, 5]"),
    ("--ngram-min 2", "--ngram-min: needs --speculative ngram"),
    ("--no-verify-checksums", "--no-verify-checksums: needs --checkpoint"),
])
def test_serve_flags_are_checked_before_the_engine_is_built(capsys, line, message):
    from dsv41.cli import serve
    with pytest.raises(SystemExit) as exit_:
        serve.main(line.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m dsv41.serve: error: ") and message in err


def test_help_says_what_batch_means(capsys):
    with pytest.raises(SystemExit) as exit_:
        run.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "requests in total" in out and "--connect-timeout" in out and "30 s" in out


def test_budget_names_the_need_against_what_is_available():
    a = run.parse_args(["--batch", "2"])
    assert check_budget(a, TINY) is None
    msg = check_budget(a, TINY, available=10 ** 6)
    assert msg.startswith("tiny needs at least 0.0") and "4 card(s)" in msg and "0.001 GB available" in msg
    assert msg.endswith("python -m dsv41.run --plan --config tiny --tp 2 --dp 2")


def test_debug_shows_the_traceback():
    with pytest.raises(rules.UsageError, match="--tp"):
        run.main(["--tp", "3", "--debug"])


def _cli(*argv, env=None, cwd=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "dsv41.run", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(240)
def test_real_processes_print_one_line_and_no_traceback(tmp_path):
    for argv, start in [(["--executor", "distributed", "--address", "tcp://127.0.0.1:1"],
                         "--address tcp://127.0.0.1:1: connection refused"),
                        (["--config", "flash"], "--config: flash needs at least")]:
        r = _cli(*argv, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(PROG + start), r.stderr
    assert list(tmp_path.iterdir()) == []


# ---- distributed: a scheduler the test starts ------------------------------------------------------------

@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """A dask scheduler with workers named '0' (1 thread), '2' (2 threads) and 'a' (1 thread)."""
    folder = tmp_path_factory.mktemp("scheduler")
    scheduler, address = start_scheduler(folder, cwd=folder)
    procs = [scheduler]
    try:
        for name, threads in [("0", 1), ("2", 2), ("a", 1)]:
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                           "--name", name, "--nthreads", str(threads), "--no-nanny",
                                           "--no-dashboard"],
                                          cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client
        with Client(address, timeout=60) as c:
            c.wait_for_workers(3, timeout=120)
        yield address
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


@pytest.mark.timeout(300)
def test_distributed_connection_failures(capsys, monkeypatch, tmp_path, scheduler):
    monkeypatch.chdir(tmp_path)
    dist = ["--executor", "distributed", "--address", scheduler, "--connect-timeout", "2"]

    msg = _error_line(capsys, dist + ["--tp", "4", "--dp", "1"], started=True)   # '2' has two threads: at once
    assert msg.startswith(PROG + f"--address {scheduler}: expected 4 worker(s) named 0..3 with one thread each; ")
    assert msg.endswith("the scheduler has 3: '0' (1 thread), '2' (2 threads), 'a' (1 thread)")

    t0 = time.monotonic()
    msg = _error_line(capsys, dist + ["--tp", "2", "--dp", "1"], started=True)   # '1' missing: at the timeout
    assert msg == (PROG + f"--address {scheduler}: expected 2 worker(s) named 0..1 with one thread each within 2 s; "
                   "the scheduler has 3: '0' (1 thread), '2' (2 threads), 'a' (1 thread)")
    assert time.monotonic() - t0 >= 2        # it waited for the connect timeout (a hang: the test's timeout)

    msg = _error_line(capsys, ["--executor", "distributed", "--address", "tcp://10.255.255.1:8786",
                               "--connect-timeout", "1"], started=True)    # nothing answers there
    assert msg.startswith(PROG + "--address tcp://10.255.255.1:8786: ")

    msg = _error_line(capsys, ["--executor", "distributed", "--address", "tcp://127.0.0.1:1"], started=True)
    assert msg == PROG + "--address tcp://127.0.0.1:1: connection refused: no dask scheduler listens there"


def test_an_error_past_the_checks_is_one_line_and_stops_tracing(capsys, monkeypatch, tmp_path):
    from dsv41.cluster import registry
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "prompts_for", lambda cfg, batch, length, seed: [[cfg.vocab_size] * length] * batch)
    assert run.main(["--executor", "sync", "--tp", "1", "--dp", "1", "--batch", "1", "--prompt-len", "3",
                     "--trace", "t"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("python -m dsv41.run: error: ValueError: token_ids: must be ints in [0, 511], got 512 "
                   "(--debug shows the traceback)")
    assert all(registry.find(e).hooks.tracer is None for e in registry.engines())


# ---- numbers are ASCII digits, flags are never abbreviated (issue 60, item 8) ---------------------------

def _entry(name):
    from dsv41.cli import replay, serve, write_checkpoint
    return {"run": run.main, "serve": serve.main, "checkpoint.write": write_checkpoint.main,
            "replay": replay.main}[name]


# (entry point, its command line, the line's start after "error: ") for every python -m dsv41.* command
NOT_NUMBERS_OR_ABBREVIATED = [
    ("run", "--batch ٣", "argument --batch: invalid int value: '٣' (expected ASCII digits 0-9"),
    ("run", "--batch 1_0", "argument --batch: invalid int value: '1_0'"),
    ("run", "--batch ３", "argument --batch: invalid int value: '３'"),           # a full-width digit
    ("run", "--tp 2\u00a0", "argument --tp: invalid int value: '2\\xa0'"),       # int() strips blanks
    ("run", "--executor distributed --connect-timeout ١٠", "argument --connect-timeout: invalid float value: '١٠'"),
    ("run", "--executor distributed --connect-timeout 1_0", "argument --connect-timeout: invalid float value"),
    ("run", "--temperature 0.5_0", "argument --temperature: invalid float value"),
    ("run", "--exec sync", "unrecognized arguments: --exec sync"),
    ("run", "--new 3", "unrecognized arguments: --new 3"),
    ("serve", "--max-queue ٣", "argument --max-queue: invalid int value: '٣'"),
    ("serve", "--read-timeout 1_0", "argument --read-timeout: invalid float value: '1_0'"),
    ("serve", "--max-q 3", "unrecognized arguments: --max-q 3"),
    ("checkpoint.write", "ck --seed ٣", "argument --seed: invalid int value: '٣'"),
    ("checkpoint.write", "ck --shard-mb 1_0", "argument --shard-mb: invalid float value: '1_0'"),
    ("checkpoint.write", "ck --shard 1", "unrecognized arguments: --shard 1"),
    ("replay", "x.pt --re", "unrecognized arguments: --re"),
]


@pytest.mark.parametrize("entry, line, words", NOT_NUMBERS_OR_ABBREVIATED,
                         ids=[f"{e}:{line}" for e, line, _ in NOT_NUMBERS_OR_ABBREVIATED])
def test_numbers_are_ascii_digits_and_flags_are_never_abbreviated(capsys, monkeypatch, tmp_path, entry, line, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        _entry(entry)(line.split(" "))
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith(f"python -m dsv41.{entry}: error: {words}"), lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("line", ["--batch 3", "--batch -0", "--seed 007", "--temperature 0.5",
                                  "--executor distributed --connect-timeout 1e1",
                                  "--executor distributed --connect-timeout .5"])
def test_ascii_numbers_still_parse(line):
    a = run.build_parser().parse_args(line.split())
    flag, text = line.split()[-2:]
    assert getattr(a, flag[2:].replace("-", "_")) == (int(text) if flag in ("--batch", "--seed") else float(text))


def test_an_empty_prompt_is_refused(capsys, monkeypatch, tmp_path, tiny_checkpoint):
    monkeypatch.chdir(tmp_path)
    msg = _error_line(capsys, ["--checkpoint", str(tiny_checkpoint), "--prompt", "hi", "--prompt", ""])
    assert msg == PROG + "--prompt: prompt 1 is empty; give the text to continue"
    assert list(tmp_path.iterdir()) == []
