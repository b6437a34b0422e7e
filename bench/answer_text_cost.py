"""CPU seconds the server spends on one long answer's text outside the model: the chat parsers
(reasoning and tool calls, ``serving/chat_answer.py``) fed an answer with a long tool call a few
characters at a time, as a stream delivers it, and ``ops/stopping.Stops`` turning the answer's
tokens into text one token at a time (on the engine thread, which serves every request).

    python bench/answer_text_cost.py [--kb 50 200] [--tokens 1750 3500 7000] [--step 4]

Each figure is process CPU time of one run; the ratio between sizes shows the growth (x4 in the
size: ~x4 when linear, ~x16 when quadratic). The tokenizer is a TINY checkpoint's, written to a
temporary folder.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

from dsv41.checkpoint.text import TextCodec
from dsv41.checkpoint.writer import write_checkpoint
from dsv41.config import TINY
from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops
from dsv41.serving.chat_answer import ChatAnswer

D = "｜DSML｜"


def parsers_s(kb: int, step: int) -> float:
    value = json.dumps({"data": "x" * (kb * 1000)})
    text = (f"thinking</think>ok\n\n<{D} calls>\n<{D} invoke name=\"f\">\n"
            f"<{D} parameter name=\"a\" string=\"false\">{value}</{D} parameter>\n</{D} invoke>\n</{D} calls>")
    answer, t = ChatAnswer(thinking=True, tools=True), time.process_time()
    for i in range(0, len(text), step):
        answer.feed(text[i:i + step])
    answer.flush()
    return time.process_time() - t


def stops_s(codec: TextCodec, ids: list[int]) -> float:
    stops, t = Stops(SamplingParams(max_tokens=len(ids) + 1), decode_text=codec.decode_answer), time.process_time()
    for token in ids:
        stops.push(token)
    return time.process_time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kb", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1750, 3500, 7000])
    ap.add_argument("--step", type=int, default=4, help="characters a streamed delta")
    args = ap.parse_args()
    for kb in args.kb:
        print(f"parsers, {kb} KB of arguments in {args.step}-character deltas: {parsers_s(kb, args.step):.3f} s")
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(TINY, folder, seed=0, shard_bytes=2_000_000)
        codec = TextCodec.load(folder)
        ids = codec.tokenizer.encode("some words, 日本語 and 😀 here " * (max(args.tokens) // 4),
                                     add_special_tokens=False).ids
        for n in args.tokens:
            print(f"Stops, {n} tokens of text one token at a time: {stops_s(codec, ids[:n]):.3f} s")


if __name__ == "__main__":
    main()
