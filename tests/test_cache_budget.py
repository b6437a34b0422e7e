"""The cache budget (issue 60, item 5): ``--max-total-tokens`` is checked at start-up against what one
request of the served context needs, in one line, so a request the server accepts always fits: at
the least budget a request filling the whole context is answered and ``/health`` stays ok; one
token less is refused before the engine is built (it used to be accepted, and such a request got a
500 while ``/health`` turned 503)."""
import os
import subprocess
import sys

import pytest

from dsv41.capacity import capacity_of
from dsv41.config import TINY
from dsv41.engine.blocks import PoolExhausted, least_cache_tokens
from dsv41.engine.reference import ReferenceEngine
from dsv41.engine.request import requests_for
from dsv41.engine.scheduler import Scheduler

httpx = pytest.importorskip("httpx")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT, BATCH = 256, 2             # the server of test_serve_hostile.Served: reference, --max-batch 2


@pytest.mark.timeout(600)
def test_a_budget_below_one_request_is_refused_and_the_least_serves_the_whole_context():
    from test_serve_hostile import Served
    least = least_cache_tokens(TINY, BATCH, CONTEXT, capacity_of(TINY).prefill_max_tokens)
    assert BATCH < least < BATCH * CONTEXT
    full = [(7 * i) % 500 + 1 for i in range(CONTEXT - 4)]
    # the boundary is exact: in pools one token smaller a request filling the context never fits
    short = ReferenceEngine(TINY, seed=0, max_batch=BATCH, max_context=CONTEXT, cache_tokens=least - 1)
    with pytest.raises(PoolExhausted):
        Scheduler(short).run(requests_for([full], None, 4, None))
    p = subprocess.run([sys.executable, "-m", "dsv41.serve", "--executor", "reference", "--max-batch", str(BATCH),
                        "--max-context", str(CONTEXT), "--max-total-tokens", str(least - 1), "--port", "0"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines()[-1].startswith("python -m dsv41.serve: error: --max-total-tokens: must be in "
                                                        f"[{least}, {BATCH * CONTEXT}]")
    assert len(p.stderr.strip().splitlines()) <= 2 and "Traceback" not in p.stderr      # usage line, error line
    server = Served("--max-context", str(CONTEXT), "--max-total-tokens", str(least))
    try:
        status, body = server.post("/v1/completions", {"prompt": full, "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True})
        assert status == 200 and body["usage"]["total_tokens"] == CONTEXT, body
        status, body = server.post("/v1/completions", {"prompt": full + [1, 2, 3, 4], "max_tokens": 1})
        assert (status, body["error"]["param"]) == (400, "prompt"), body
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        server.stop()
