"""Claims of README.md and docs/ that no other test states: each test names the file and the sentence
it backs, and test_the_claims_are_where_the_tests_say checks each sentence is still in its file."""
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from dsv41.config import TINY
from dsv41.engine.reference import ReferenceEngine
from dsv41.run import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path, sentence", [
    ("docs/numerics.md", "a 4-slot ring per request (`ModelConfig.state_capacity`, the device ABI); official keeps "
                         "a 2-slot carry, same math"),
    ("docs/numerics.md", "Each process uses one intra-op torch thread (`DSV41_TORCH_THREADS` overrides"),
    ("docs/cli.md", "The graph executors and the reference print the same `last_logits_sha256` for the default run"),
    ("docs/tracing.md", "Any OTLP JSON reader takes it unchanged"),
])
def test_the_claims_are_where_the_tests_say(path, sentence):
    """Each test below backs a sentence of the named file; a move or a rewording must carry the test along."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = re.sub(r"\s+", " ", f.read())
    assert sentence in text, f"{path} no longer says: {sentence}"


def _tokens(n, seed):
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_two_slot_carry_is_the_same_math_as_the_four_slot_ring():
    """docs/numerics.md, choices table: "a 4-slot ring per request (...); official keeps a 2-slot carry, same math".
    Odd and even prompt lengths, so ratio-2 groups close across the prefill/decode boundary and
    across decode steps (partner read from the ring); logits must be the same bytes."""
    prompts = [_tokens(5, 1), _tokens(4, 2)]
    runs = []
    for cap in (2, 4):
        m = ReferenceEngine(replace(TINY, state_capacity=cap), seed=0, max_batch=2, max_context=16)
        logits = [m.prefill(prompts).logits]
        rids = list(m.last_request_ids)
        for _ in range(2):
            logits.append(m.decode(torch.argmax(logits[-1], -1).tolist(), rids).logits)
        runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, want", [({}, 1), ({"DSV41_TORCH_THREADS": "3"}, 3)])
def test_one_torch_thread_per_process(env, want):
    """docs/numerics.md: "Each process uses one intra-op torch thread (DSV41_TORCH_THREADS overrides)"."""
    clean = {k: v for k, v in os.environ.items() if k != "DSV41_TORCH_THREADS"}
    out = subprocess.run([sys.executable, "-c", "import dsv41, torch; print(torch.get_num_threads())"],
                         env={**clean, **env}, capture_output=True, text=True, timeout=50, check=True)
    assert int(out.stdout) == want


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_run_graph_and_reference_print_the_same_sha(capsys):
    """docs/cli.md, --json: "The graph executors and the reference print the same last_logits_sha256 for the
    default run" (python -m dsv41.run --graph decode: TINY, TP2/DP2/EP4, threads, sharded)."""
    def run(*extra):
        assert main(["--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    graph, ref = run(), run("--executor", "reference")
    assert graph["executor"] == "threads" and graph["topology"] == {"tp": 2, "dp": 2, "ep": 4}
    assert graph["tokens"] == ref["tokens"]
    assert graph["last_logits_sha256"] == ref["last_logits_sha256"]


def test_otlp_file_parses_as_the_otlp_protobuf_json_mapping(capsys, tmp_path, monkeypatch):
    """docs/tracing.md: "Any OTLP JSON reader takes it unchanged": every line parses strictly (no unknown
    field, every value of its field's type) into opentelemetry-proto's ExportTraceServiceRequest, the
    message OTLP/JSON readers decode. OTLP/JSON differs from protobuf's JSON mapping only in trace
    and span ids (hex, not base64), so those are checked on the raw text."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    monkeypatch.chdir(tmp_path)
    assert main(["--executor", "sync", "--tp", "2", "--dp", "1", "--batch", "1", "--prompt-len", "4",
                 "--new-tokens", "2", "--trace", "otlp", "--json"]) == 0
    path = json.loads(capsys.readouterr().out)["traces"]["otlp"]
    lines = open(tmp_path / path).read().splitlines()
    assert len(lines) == 2
    for line in lines:
        spans = json_format.Parse(line, ExportTraceServiceRequest()).resource_spans[0].scope_spans[0].spans
        assert len(spans) > 100 and all(s.end_time_unix_nano >= s.start_time_unix_nano > 1.6e18 for s in spans)
        for s in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            assert len(bytes.fromhex(s["traceId"])) == 16 and len(bytes.fromhex(s["spanId"])) == 8
