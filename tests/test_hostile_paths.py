"""Paths, values and outputs a hostile or careless user tries (issue 31): every file of a checkpoint
is read from inside its folder (no symlink out; a symlink loop or a NUL path is one line), trace
outputs never follow a symlink, config numbers have plausible ranges, logits that cannot tell tokens
apart stop the step like NaN ones, the OTEL_* variables and a tls:// address are checked up front,
and the run's answer is printed before outputs that may fail."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41.checkpoint import config_json
from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.headers import INDEX
from dsv41.checkpoint.text import TOKENIZER, TOKENIZER_CONFIG
from dsv41.cli import run
from dsv41.model.finite import LOGITS, ConstantLogitsError, NonFiniteError, ensure_finite
from dsv41.outputs import open_output
from dsv41.telemetry.export import write_traces
from checkpoint_edits import fill

REPO = Path(__file__).resolve().parents[1]
PROG = "python -m dsv41.run: error: "
RUN = ("--executor", "reference", "--prompt", "The river", "--new-tokens", "2")


def _cli(*argv, module="dsv41.run", env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=cwd or REPO,
                          stdin=subprocess.DEVNULL)


def _one_line(r, prog="python -m dsv41.run") -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return lines[0]


def _in_process_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        run.main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ---- checkpoint files confined to the folder ---------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [TOKENIZER, "config.json", TOKENIZER_CONFIG, INDEX])
def test_a_checkpoint_file_symlinked_outside_is_refused(tmp_path, tiny_checkpoint, name):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    outside = tmp_path / f"outside-{name}"
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    line = _one_line(_cli("--checkpoint", str(folder), *RUN))
    assert f"{folder / name}: expected a file inside the checkpoint folder" in line, line
    assert "outside it (through a symlink)" in line, line
    if name == TOKENIZER:        # the server refuses it the same way, before it listens
        line = _one_line(_cli("--checkpoint", str(folder), "--executor", "reference", "--port", "0",
                              module="dsv41.serve"), prog="python -m dsv41.serve")
        assert "outside it (through a symlink)" in line, line


@pytest.mark.timeout(600)
def test_a_shard_symlink_loop_and_a_nul_path_are_one_line(tmp_path, tiny_checkpoint):
    loop = tmp_path / "loop"
    shutil.copytree(tiny_checkpoint, loop)
    shard = json.loads((loop / INDEX).read_text())["weight_map"]["head.weight"]
    (loop / shard).unlink()
    (loop / shard).symlink_to(loop / "other")
    (loop / "other").symlink_to(loop / shard)
    line = _one_line(_cli("--checkpoint", str(loop), *RUN))
    assert f"'{shard}', which is a symlink loop" in line, line

    nul = tmp_path / "nul"
    shutil.copytree(tiny_checkpoint, nul)
    index = json.loads((nul / INDEX).read_text())
    index["weight_map"]["head.weight"] = "model\x00.safetensors"
    (nul / INDEX).write_text(json.dumps(index))
    line = _one_line(_cli("--checkpoint", str(nul), *RUN))
    assert "tensor 'head.weight'" in line and "which holds a NUL byte" in line, line


@pytest.mark.timeout(600)
def test_checkpoint_write_makes_missing_parents_and_names_a_file_in_the_way(tmp_path):
    r = _cli(str(tmp_path / "a" / "b" / "ck"), module="dsv41.checkpoint.write")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a" / "b" / "ck" / "config.json").is_file()
    (tmp_path / "file").write_text("x")
    r = _cli(str(tmp_path / "file" / "ck"), module="dsv41.checkpoint.write")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith(f"path: {tmp_path / 'file'} is a file; expected a folder to write into")


# ---- trace outputs never follow a symlink -------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_symlinked_trace_output_is_refused_and_never_written_through(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces").mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "traces" / "x.perfetto.json").symlink_to(victim)
    line = _in_process_line(capsys, ["--trace", "x"])
    assert line == PROG + "--trace: traces/x.perfetto.json is a symbolic link; the run writes a plain file there " \
                          "and never follows a link"
    with pytest.raises(OSError):               # the writer itself, should the link appear after the check
        write_traces("x", [], {}, tmp_path / "traces")
    with pytest.raises(OSError):
        open_output(tmp_path / "traces" / "x.perfetto.json")
    assert victim.read_text() == "keep"


# ---- config ranges and logits that cannot tell tokens apart -------------------------------------------

@pytest.mark.parametrize("key,value", [("hc_sinkhorn_iters", 10 ** 9), ("rms_norm_eps", 1e300),
                                       ("rope_theta", 1e300), ("compress_rope_theta", 1e300),
                                       ("hc_eps", 1e300), ("rms_norm_eps", 1e-300)])
def test_config_numbers_need_a_plausible_range(tiny_checkpoint, key, value):
    doc = json.loads((tiny_checkpoint / "config.json").read_text())
    config_json.from_json(doc, "ok")             # the writer's own file passes
    doc["text_config"][key] = value
    with pytest.raises(CheckpointError) as e:
        config_json.from_json(doc, "bad")
    assert str(e.value).startswith(f"config.json: text_config.{key}: must be in ["), e.value


def test_a_constant_logits_row_stops_the_step_like_a_nan_one():
    good = torch.randn(3, 50)
    assert ensure_finite(good, None, LOGITS) is good
    flat = good.clone()
    flat[1] = 0.25
    with pytest.raises(ConstantLogitsError) as e:
        ensure_finite(flat, None, LOGITS)
    assert isinstance(e.value, NonFiniteError)
    assert "row 1: all 50 values equal 0.25; 1 of 3 rows so" in str(e.value)
    assert "cannot tell tokens apart" in str(e.value.at(4, "decode", ("head.weight",)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("value", [0.0, 1.0, 1e-38])
def test_a_head_that_cannot_tell_tokens_apart_is_refused(tmp_path, tiny_checkpoint, value):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    fill(folder, "head.weight", value)
    r = _cli("--checkpoint", str(folder), *RUN)
    line = _one_line(r)
    assert "the logits cannot tell tokens apart" in line and "head.weight" in line, line
    assert "tokens:" not in r.stdout


# ---- environment and addresses ------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("variable,value,words", [
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", "OTEL_EXPORTER_OTLP_TIMEOUT: expected a number > 0, got 'abc'"),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-5", "expected a number > 0, got '-5'"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL: only http/protobuf is exported"),
])
def test_otel_variables_are_checked(capsys, monkeypatch, tmp_path, variable, value, words):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv(variable, value)
    assert words in _in_process_line(capsys, [])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["tls", "wss"])
def test_a_tls_address_is_refused_as_needing_tls_settings(capsys, scheme):
    line = _in_process_line(capsys, ["--executor", "distributed", "--address", f"{scheme}://127.0.0.1:8786"])
    assert line.startswith(PROG + f"--address: {scheme}:// needs TLS settings"), line


@pytest.mark.timeout(120)
def test_an_unwritable_simulated_times_cache_is_refused_up_front(capsys, monkeypatch, tmp_path):
    pytest.importorskip("pypto")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("DSV41_PYPTO_CACHE", str(blocker / "sim_times.json"))
    monkeypatch.chdir(tmp_path)
    line = _in_process_line(capsys, ["--backend", "pypto-sim"])
    assert line.startswith(PROG + f"--backend: cannot make the simulated-times cache's folder {blocker}"), line


# ---- the answer before the outputs --------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_an_ascii_terminal_gets_the_answer_escaped(tiny_checkpoint):
    r = _cli("--checkpoint", str(tiny_checkpoint), "--executor", "reference", "--prompt", "Café naïve",
             "--new-tokens", "3", env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0, r.stderr
    assert "last_logits_sha256" in r.stdout and "text[0]" in r.stdout


@pytest.mark.timeout(600)
def test_an_output_that_fails_after_the_work_keeps_the_answer(tmp_path, capsys, monkeypatch):
    import errno

    from dsv41.cli import trace

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trace, "write_traces", full)
    status = run.main(["--executor", "sync", "--trace", "x", "--new-tokens", "2", "--batch", "1"])
    out, err = capsys.readouterr()
    assert status == 1 and "No space left on device" in err
    assert "tokens: [[" in out and "last_logits_sha256: " in out
    status = run.main(["--executor", "sync", "--trace", "x", "--new-tokens", "2", "--batch", "1", "--json"])
    out, err = capsys.readouterr()
    assert status == 1 and json.loads(out)["tokens"]
