"""Real clients written for vLLM, unchanged, against ``python -m dsv41.serve``: guidellm runs a
benchmark, lm-eval's ``local-completions`` and ``local-chat-completions`` models run a task (the
local one in tests/data/lm_eval: the hub's data sets cannot be reached here). On TINY's random
weights the scores are noise: what is checked is that each client runs to its end and reports
every request as served.

The clients pull torch, transformers and datasets; install them in a virtual environment of their
own (they only speak HTTP to the server), then point ``--clients`` at its ``bin``:

    python -m venv /tmp/clients && /tmp/clients/bin/pip install guidellm "lm-eval[api]"
    python -m dsv41.serve --executor reference --checkpoint CKPT --served-model-name tiny \\
        --max-context 256 --port 8471 &
    python bench/real_clients.py --url http://127.0.0.1:8471 --model tiny --processor CKPT \\
        --clients /tmp/clients/bin

Each client's command is printed before it runs; the exit status is 0 when every client passed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASK = "dsv41_tiny_qa"
DOCS = sum(1 for _ in open(TASK_DIR / "tiny_qa.jsonl"))
GUIDELLM_REQUESTS = 6
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    print("$ " + " ".join(command), flush=True)
    out = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{command[0]} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def guidellm(url: str, model: str, clients: Path, processor: str, folder: Path, timeout: float = 1800) -> dict:
    """guidellm's synchronous benchmark (guidellm 0.8's ``run``) of GUIDELLM_REQUESTS synthetic requests
    (16 prompt tokens, 4 output tokens, counted with the checkpoint's tokenizer); its report's
    request totals."""
    report = folder / "guidellm.json"
    _run([str(clients / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model={model}",
          "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
          "--tokenizer", f"kind=huggingface_auto,model={processor}",
          "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=4",
          "--output", f"kind=json,path={report}", "--disable-console-interactive"], timeout)
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    if totals["successful"] != GUIDELLM_REQUESTS or totals["errored"] != 0 or \
            benchmark["metrics"]["output_token_count"]["successful"]["total_sum"] != 4 * GUIDELLM_REQUESTS:
        raise RuntimeError(f"guidellm: {totals}")
    return totals


def lm_eval(url: str, model: str, clients: Path, chat: bool, folder: Path, timeout: float = 1800) -> dict:
    """lm-eval's local task through local-chat-completions (chat) or local-completions; its
    results, every document scored."""
    kind, path = ("local-chat-completions", "/v1/chat/completions") if chat else ("local-completions",
                                                                                "/v1/completions")
    out = folder / kind
    # tokenizer_backend None: lm-eval would load the model's tokenizer from the hub, which is not needed
    # to generate (it only checks context lengths, which the server checks anyway)
    args = (f"model={model},base_url={url}{path},num_concurrent=2,max_retries=1,tokenized_requests=False,"
            "tokenizer_backend=None")
    _run([str(clients / "lm_eval"), "--model", kind, "--model_args", args, "--tasks", TASK,
          "--include_path", str(TASK_DIR), "--output_path", str(out), "--log_samples",
          *(["--apply_chat_template"] if chat else [])], timeout)
    results = json.loads(Path(sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]).read_text())
    samples = results["n-samples"][TASK]
    if samples["effective"] != DOCS or "exact_match,none" not in results["results"][TASK]:
        raise RuntimeError(f"lm_eval {kind}: {samples}, {results['results'][TASK]}")
    return results["results"][TASK]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8471")
    p.add_argument("--model", required=True, help="its --served-model-name")
    p.add_argument("--processor", required=True, help="the checkpoint folder (guidellm counts tokens with its tokenizer)")
    p.add_argument("--clients", required=True, type=Path, help="the bin folder where guidellm and lm_eval are")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print("guidellm:", guidellm(a.url, a.model, a.clients, a.processor, folder))
        print("lm_eval local-completions:", lm_eval(a.url, a.model, a.clients, False, folder))
        print("lm_eval local-chat-completions:", lm_eval(a.url, a.model, a.clients, True, folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
