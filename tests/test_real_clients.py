"""guidellm and lm-eval, unchanged, against ``python -m dsv41.serve`` on the TINY checkpoint
(``bench/real_clients.py``; killed by its PID at the end). The clients live in a virtual
environment of their own (they pull torch and transformers): ``DSV41_CLIENTS`` names its ``bin``
folder (default: the folder of the ``lm_eval`` on PATH)."""
import os
import shutil
import sys
from pathlib import Path

import pytest

from test_serve import Served

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import real_clients  # noqa: E402


def _clients() -> Path:
    where = os.environ.get("DSV41_CLIENTS") or (shutil.which("lm_eval") and str(Path(shutil.which("lm_eval")).parent))
    if not where or not all((Path(where) / tool).exists() for tool in ("guidellm", "lm_eval")):
        pytest.fail("guidellm and lm_eval not found: python -m venv /tmp/clients && /tmp/clients/bin/pip install "
                    "guidellm \"lm-eval[api]\", then DSV41_CLIENTS=/tmp/clients/bin")
    return Path(where)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_guidellm_and_lm_eval_run_against_the_server(tiny_checkpoint, tmp_path):
    clients = _clients()
    server = Served("--checkpoint", str(tiny_checkpoint), "--served-model-name", "tiny", "--max-context", "256")
    try:
        totals = real_clients.guidellm(server.url, "tiny", clients, str(tiny_checkpoint), tmp_path)
        assert totals["successful"] == real_clients.GUIDELLM_REQUESTS
        for chat in (False, True):
            scores = real_clients.lm_eval(server.url, "tiny", clients, chat, tmp_path)
            assert 0.0 <= scores["exact_match,none"] <= 1.0
        assert server.settled()["cache_blocks_in_use"] == 0
    finally:
        server.stop()
