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


SAMPLED = ["--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--sample-seed", "5"]


def test_speculative_ngram_gives_the_tokens_and_logits_of_plain_decode(capsys):
    plain = _run(capsys, "--executor", "reference", *SAMPLED)
    spec = _run(capsys, "--executor", "reference", *SAMPLED, "--speculative", "ngram", "--ngram-min", "1")
    graph = _run(capsys, "--executor", "sync", "--tp", "2", "--dp", "1", *SAMPLED, "--speculative", "ngram",
                 "--draft-tokens", "3")
    assert spec["tokens"] == graph["tokens"] == plain["tokens"]
    assert spec["last_logits_sha256"] == graph["last_logits_sha256"] == plain["last_logits_sha256"]
    s = spec["speculative"]
    assert s["decode_steps"] == 2 and "speculative" not in plain
    assert sum(s["tokens_per_request_step_histogram"].values()) == s["decode_steps"] * 2


def test_sampling_flags_draw_the_same_tokens_on_every_executor(capsys):
    ref = _run(capsys, "--executor", "reference", *SAMPLED)
    graph = _run(capsys, "--executor", "sync", "--tp", "2", "--dp", "1", *SAMPLED)
    greedy = _run(capsys, "--executor", "reference")
    assert graph["tokens"] == ref["tokens"] != greedy["tokens"]
    assert graph["last_logits_sha256"] == ref["last_logits_sha256"]


@pytest.mark.parametrize("extra,message", [
    (["--temperature", "-0.5"], "--temperature: expected a value in [0.0, inf], found -0.5"),
    (["--temperature", "1", "--top-p", "1.5"], "--top-p: expected a value in (0.0, 1.0], found 1.5"),
    (["--temperature", "1", "--min-p", "2"], "--min-p: expected a value in [0.0, 1.0], found 2.0"),
    (["--temperature", "1", "--sample-seed", "-1"], "--sample-seed: expected an integer in [0, "),
    (["--top-k", "5"], "--top-k: needs --temperature > 0"),
    (["--stop", "x"], "--stop: needs --checkpoint"),
])
def test_sampling_flags_name_the_flag_and_range(capsys, extra, message):
    with pytest.raises(SystemExit):
        main(ARGS + extra)
    assert message in capsys.readouterr().err
