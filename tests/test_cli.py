"""The command line: stable JSON fields, graph == reference for the same run, argument errors."""
import json

import pytest

from dsv41.run import main

ARGS = ["--batch", "2", "--prompt-len", "9", "--new-tokens", "3", "--json"]


def _run(capsys, *extra):
    assert main(ARGS + list(extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_decode_json_fields_and_graph_equals_reference(capsys):
    ref = _run(capsys, "--executor", "reference")
    assert {"graph", "config", "executor", "topology", "tokens", "step_ms", "prefill_ms",
            "last_logits_sha256"} <= set(ref)
    assert ref["topology"] == {"tp": 1, "dp": 1, "ep": 1} and len(ref["step_ms"]) == 2
    assert [len(t) for t in ref["tokens"]] == [3, 3]
    graph = _run(capsys, "--executor", "sync", "--tp", "2", "--dp", "1")
    assert graph["executor"] == "sync" and graph["topology"] == {"tp": 2, "dp": 1, "ep": 2}
    assert {"nodes", "submissions", "dask_tasks", "granularity", "wiring"} <= set(graph)
    assert graph["dask_tasks"] < graph["nodes"]
    assert graph["tokens"] == ref["tokens"]
    assert graph["last_logits_sha256"] == ref["last_logits_sha256"]


def test_prefill_graph(capsys):
    assert main(["--batch", "2", "--prompt-len", "9", "--json", "--graph", "prefill", "--executor", "reference"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["graph"] == "prefill" and out["step_ms"] == [] and [len(t) for t in out["tokens"]] == [1, 1]


def test_bad_arguments_name_the_field(capsys):
    with pytest.raises(SystemExit):
        main(["--batch", "0"])
    assert "--batch: must be in [1, 16]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tp", "2", "--dp", "2", "--ep", "2"])
    assert "--ep: must equal --tp x --dp = 4" in capsys.readouterr().err   # tests/test_cli_errors.py has the rest
