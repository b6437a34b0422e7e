"""/metrics after requests, through a real ``python -m dsv41.serve`` (killed by its PID at the
end): every series is consistent with what was served (counts, token sums, finish reasons, the
start-up probe's one-token request included), under dsv41's names and, with ``--metrics-names
both``, under vLLM's names, labels (``model_name``, ``engine``) and buckets too, as vLLM's example
dashboard and dsv41's read them; with ``--speculative ngram`` the speculative counters give the acceptance length, and
the start line names the drafter."""
import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import OneGroupEngine
from test_serve_hostile import Served, _until

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9], [4, 4, 4, 4, 4], [11, 12, 13, 14, 15, 16]]
NEW = [6, 3, 5, 4]
PROBE = 1          # the start-up probe: a one-token prompt, one token made, finish "length"


def _scrape(server) -> dict:
    """{(sample name, frozenset of labels): value} of /metrics."""
    return _samples(httpx.get(server.url + "/metrics").text)


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _serve_all(server, streamed: bool):
    """The PROMPTS, each to its NEW token count (EOS ignored), concurrently; their token ids."""
    answers = [None] * len(PROMPTS)

    def one(i):
        body = {"prompt": PROMPTS[i], "max_tokens": NEW[i], "temperature": 0, "ignore_eos": True}
        if streamed:
            ids = []
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                              timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
            answers[i] = ids
        else:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
            answers[i] = r.json()["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(a) for a in answers] == NEW, answers
    return answers


def _hang_up(server):
    """A streamed request whose client leaves after its first token: it ends as an abort."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=300,
                      json={"prompt": [3, 1], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break


def _dashboard_reads_only_what_is_served(server):
    """Every series docs/grafana-dsv41.json queries is one the server exports."""
    import re
    from pathlib import Path
    families = {f.name for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    dashboard = json.loads((Path(__file__).parent.parent / "docs" / "grafana-dsv41.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {re.sub(r"_(bucket|total)$", "", n) for e in exprs for n in re.findall(r"\b(?:dsv41|process)_\w+", e)}
    assert used and used <= families, used - families
    # each dsv41 series is read for the model the dashboard's variable picks
    assert all(re.findall(r"\bdsv41_\w+(?!\w|\{model_name=\"\$model_name\"\})", e) == [] for e in exprs), exprs
    assert "model_name" in {v["name"] for v in dashboard["templating"]["list"]}


@pytest.mark.timeout(600)
def test_dsv41_metrics_add_up_to_what_was_served():
    server = Served("--max-context", "512", "--served-model-name", "dsv")
    try:
        _serve_all(server, streamed=False)
        _serve_all(server, streamed=True)
        served, made = 2 * len(PROMPTS) + PROBE, 2 * sum(NEW) + PROBE
        prompt = 2 * sum(map(len, PROMPTS)) + PROBE
        on = dict(model_name="dsv")
        m = _scrape(server)
        # every series of dsv41's own carries the served model's name (the process's own have no labels)
        assert all(dict(labels).get("model_name") == "dsv" for name, labels in m if not name.startswith("process_"))
        assert _value(m, "dsv41_request_success_total", **on, finished_reason="length") == served
        assert _value(m, "dsv41_request_success_total", **on, finished_reason="abort") == 0
        assert _value(m, "dsv41_prompt_tokens_total", **on) == prompt
        assert _value(m, "dsv41_generation_tokens_total", **on) == made
        assert _value(m, "dsv41_request_prompt_tokens_sum", **on) == prompt
        assert _value(m, "dsv41_request_generation_tokens_sum", **on) == made
        assert _value(m, "dsv41_iteration_tokens_sum", **on) == prompt + made
        for name in ("e2e_request_latency", "time_to_first_token", "request_queue_time", "request_prefill_time",
                     "request_decode_time", "request_inference_time"):
            assert _value(m, f"dsv41_{name}_seconds_count", **on) == served, name
        # per output token: one sample per token after a request's first (vLLM's older name of the
        # inter-token latency); the per-request mean has a histogram of its own
        assert _value(m, "dsv41_time_per_output_token_seconds_count", **on) == made - served
        assert _value(m, "dsv41_request_time_per_output_token_seconds_count", **on) == 2 * sum(n > 1 for n in NEW)
        assert _value(m, "dsv41_inter_token_latency_seconds_count", **on) == made - served
        assert _value(m, "dsv41_num_preemptions_total", **on) == 0
        assert _value(m, "dsv41_running_requests", **on) == 0 and _value(m, "dsv41_kv_cache_usage_perc", **on) == 0
        _dashboard_reads_only_what_is_served(server)
        _hang_up(server)
        _until(lambda: _value(_scrape(server), "dsv41_request_success_total", **on, finished_reason="abort") == 1)
        m = _scrape(server)
        assert _value(m, "dsv41_cancelled_requests_total", **on) == 1
        assert _value(m, "dsv41_e2e_request_latency_seconds_count", **on) == served + 1
    finally:
        server.stop()


def _vllm_dashboard_reads_only_what_is_served(samples: dict):
    """Every series vLLM's example Grafana dashboard queries (tests/data: its queries, its source
    cited there) has a sample for the model the dashboard's variable picks."""
    import re
    from pathlib import Path
    dashboard = json.loads((Path(__file__).parent / "data" / "vllm-grafana-dashboard-queries.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) == 27
    read = {n for e in exprs for n in re.findall(r"vllm:\w+", e)}
    have = {name for name, labels in samples if dict(labels).get("model_name") == "dsv"}
    assert read and read <= have, read - have


def test_vllm_names_alone_leave_dsv41_twins_out():
    from dsv41.serving.metrics import Metrics
    names = {f.name for f in text_string_to_metric_families(Metrics("vllm", "m").text().decode())}
    assert "vllm:time_to_first_token_seconds" in names and "dsv41_time_to_first_token_seconds" not in names
    assert "dsv41_requests" in names          # no vLLM twin: dsv41's name
    names = {f.name for f in text_string_to_metric_families(Metrics("dsv41", "m").text().decode())}
    assert not any(n.startswith("vllm:") for n in names)


# vLLM's default series this server had no twin of (issue 59), with their Prometheus types
NEW_VLLM = {"vllm:request_time_per_output_token_seconds": "histogram", "vllm:request_params_n": "histogram",
            "vllm:request_params_max_tokens": "histogram", "vllm:request_max_num_generation_tokens": "histogram",
            "vllm:request_prefill_kv_computed_tokens": "histogram", "vllm:prompt_tokens_recomputed": "counter",
            "vllm:cache_config_info": "gauge", "vllm:engine_sleep_state": "gauge",
            "vllm:external_prefix_cache_queries": "counter", "vllm:external_prefix_cache_hits": "counter",
            "vllm:mm_cache_queries": "counter", "vllm:mm_cache_hits": "counter", "vllm:gpu_cache_usage_perc": "gauge"}


@pytest.mark.timeout(600)
def test_both_names_labels_and_buckets_with_speculative_counters():
    """--metrics-names both: vLLM's series with its names, labels and buckets and dsv41's, from one
    server: each dashboard finds every series it reads."""
    server = Served("--max-context", "512", "--metrics-names", "both", "--served-model-name", "dsv",
                    "--speculative", "ngram", "--draft-tokens", "3", "--ngram-min", "1")
    try:
        on = dict(model_name="dsv", engine="0")
        fresh = _scrape(server)      # every draft position exists at 0 before any draft is accepted
        assert all(("vllm:spec_decode_num_accepted_tokens_per_pos_total", frozenset({**on, "position": str(j)}.items()))
                   in fresh for j in range(3))
        _serve_all(server, streamed=True)
        served, made = len(PROMPTS) + PROBE, sum(NEW) + PROBE
        prompt = sum(map(len, PROMPTS)) + PROBE
        m = _scrape(server)
        on = dict(model_name="dsv", engine="0")
        assert _value(m, "vllm:request_success_total", finished_reason="length", **on) == served
        assert ("vllm:request_success_total", frozenset({**on, "finished_reason": "abort"}.items())) in m
        assert _value(m, "vllm:prompt_tokens_total", **on) == prompt
        assert _value(m, "vllm:generation_tokens_total", **on) == made
        assert _value(m, "vllm:request_generation_tokens_sum", **on) == made
        assert _value(m, "vllm:iteration_tokens_total_sum", **on) == prompt + made
        assert _value(m, "vllm:e2e_request_latency_seconds_count", **on) == served
        assert _value(m, "vllm:num_requests_running", **on) == 0 and _value(m, "vllm:num_requests_waiting", **on) == 0
        assert _value(m, "vllm:kv_cache_usage_perc", **on) == 0
        # vLLM's buckets: a dashboard's histogram_quantile reads the same edges
        assert ("vllm:time_to_first_token_seconds_bucket", frozenset({**on, "le": "2560.0"}.items())) in m
        assert ("vllm:e2e_request_latency_seconds_bucket", frozenset({**on, "le": "7680.0"}.items())) in m
        assert ("vllm:request_prompt_tokens_bucket", frozenset({**on, "le": "500.0"}.items())) in m
        # dsv41's twins beside them, the same counts
        assert _value(m, "dsv41_request_success_total", model_name="dsv", finished_reason="length") == served
        assert _value(m, "dsv41_generation_tokens_total", model_name="dsv") == made
        # the series vLLM's loggers add, with its types and buckets
        types = {f.name: f.type for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
        assert {n: types.get(n) for n in NEW_VLLM} == NEW_VLLM
        assert _value(m, "vllm:time_per_output_token_seconds_count", **on) == made - served    # per token
        assert _value(m, "vllm:request_time_per_output_token_seconds_count", **on) == len(PROMPTS)
        assert _value(m, "vllm:request_params_n_count", **on) == _value(m, "vllm:request_params_n_sum", **on) == served
        assert ("vllm:request_params_n_bucket", frozenset({**on, "le": "20.0"}.items())) in m
        assert _value(m, "vllm:request_params_max_tokens_sum", **on) == sum(NEW) + PROBE
        assert ("vllm:request_params_max_tokens_bucket", frozenset({**on, "le": "500.0"}.items())) in m
        assert _value(m, "vllm:request_max_num_generation_tokens_sum", **on) == made
        assert _value(m, "vllm:request_prefill_kv_computed_tokens_sum", **on) == \
            _value(m, "vllm:prompt_tokens_by_source_total", source="local_compute", **on) > 0
        assert _value(m, "vllm:prompt_tokens_recomputed_total", **on) == 0
        assert _value(m, "vllm:gpu_cache_usage_perc", **on) == _value(m, "vllm:kv_cache_usage_perc", **on) == 0
        for name in ("external_prefix_cache_queries", "external_prefix_cache_hits", "mm_cache_queries",
                     "mm_cache_hits"):
            assert (f"vllm:{name}_total", frozenset(on.items())) in m and _value(m, f"vllm:{name}_total", **on) == 0
        assert [_value(m, "vllm:engine_sleep_state", sleep_state=s, **on)
                for s in ("awake", "weights_offloaded", "discard_all")] == [1, 0, 0]
        info = [dict(labels) for name, labels in m if name == "vllm:cache_config_info"]
        assert len(info) == 1 and info[0]["enable_prefix_caching"] == "True" and int(info[0]["num_gpu_blocks"]) > 0
        _vllm_dashboard_reads_only_what_is_served(m)
        _dashboard_reads_only_what_is_served(server)
        # the series vLLM has no twin of keep dsv41's names, with the model's name too
        assert all(dict(labels).get("model_name") == "dsv" for name, labels in m if not name.startswith("process_"))
        assert _value(m, "dsv41_requests_total", model_name="dsv", endpoint="/v1/completions", status="200") == \
            len(PROMPTS)
        # speculative decoding: drafts, draft tokens and accepted ones agree, per position too
        drafts = _value(m, "vllm:spec_decode_num_drafts_total", **on)
        drafted = _value(m, "vllm:spec_decode_num_draft_tokens_total", **on)
        accepted = _value(m, "vllm:spec_decode_num_accepted_tokens_total", **on)
        per_pos = [_value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j), **on)
                   for j in range(3)]
        assert drafts > 0 and drafts <= drafted <= 3 * drafts and accepted <= drafted, (drafts, drafted, accepted)
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True), per_pos
        assert 1 <= 1 + accepted / drafts <= 4         # the mean acceptance length a dashboard computes
        server.stop()
        start_line = server.started.splitlines()[-1]        # the server's start line says where it listens
        assert "speculative decoding: ngram (3 draft tokens, suffixes of 1-" in start_line, start_line
    finally:
        server.stop()


class _TightEngine(OneGroupEngine):
    """One token per request and step; the first time two requests decode, the block manager says
    their step does not fit, so the scheduler preempts the newer one and recomputes it later."""

    max_context = 64

    def __init__(self):
        from dsv41.config import TINY
        super().__init__()
        self.cfg, self.full_once = TINY, True

    def token(self, rid):
        return 5

    def fits(self, group, needs):
        if self.full_once and [n["rows"] for n in needs] == [1, 1]:     # two decode rows
            self.full_once = False
            return False
        return True

    def blocks_in_use(self):
        return 1, 4


def test_a_preemption_is_counted_once():
    import asyncio

    from dsv41.ops.sampling import SamplingParams
    from dsv41.ops.stopping import Stops
    from dsv41.serving.batcher import Batcher, Job
    from dsv41.serving.metrics import Metrics

    metrics = Metrics(model="m")
    batcher = Batcher(_TightEngine(), metrics, max_batch=2, max_queue=4, budget=64)
    batcher.start()

    async def serve_two():
        loop = asyncio.get_running_loop()
        params = SamplingParams(max_tokens=4)
        jobs = [Job([1, 2], params, Stops(params), loop) for _ in range(2)]
        for job in jobs:
            batcher.submit(job)
        ends = []
        for job in jobs:
            while (event := await job.events.get()).kind == "token":
                pass
            ends.append(event.finish)
        return jobs, ends

    try:
        jobs, ends = asyncio.run(serve_two())
    finally:
        batcher.stop()
    m = _samples(metrics.text().decode())
    assert ends == ["length", "length"] and sum(job.preemptions for job in jobs) == 1
    assert _value(m, "dsv41_num_preemptions_total", model_name="m") == 1
    # the preempted request's history computed again: its 2 prompt tokens and the 1 it had made
    assert _value(m, "dsv41_prompt_tokens_recomputed_total", model_name="m") == 3
    assert _value(m, "dsv41_request_success_total", model_name="m", finished_reason="length") == 2
    assert _value(m, "dsv41_kv_cache_usage_perc", model_name="m") == 0.25
