"""The answer parsers (reasoning, tool calls) against hostile model output: values JSON cannot
carry (huge numbers, deep nesting, lone-surrogate escapes, NaN/Infinity), tags left open, a
megabyte of arguments. Whole and streamed at every split point they never raise, the streamed
deltas add up to the whole answer, ``arguments`` is always standard JSON a strict reader takes,
and the work (characters handed to the parsers' regular expressions) is linear in the text."""
import json
import re

import pytest

from dsv41.serving import reasoning, tool_calls
from dsv41.serving.chat_answer import ChatAnswer

D = "｜DSML｜"

# (value as the model writes it with string="false", what arguments must hold for it)
HOSTILE = [
    ("9" * 5000, "9" * 5000),                       # past Python's 4300 digits: ValueError in json.loads
    ("-" + "9" * 4301, "-" + "9" * 4301),
    ("[" * 1000 + "]" * 1000, "[" * 1000 + "]" * 1000),   # RecursionError territory
    ("[" * 1000, "[" * 1000),
    ('{"a":' * 600 + "1" + "}" * 600, '{"a":' * 600 + "1" + "}" * 600),
    ('"\\ud800"', '"\\ud800"'),                     # decodes to a lone surrogate: not UTF-8
    ('{"\\udfff": 1}', '{"\\udfff": 1}'),
    ('["ok", "\\ud800x"]', '["ok", "\\ud800x"]'),
    ("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"),
    ("[1, NaN]", "[1, NaN]"), ('{"a": {"b": Infinity}}', '{"a": {"b": Infinity}}'),
    ("1e999", "1e999"), ("-1e400", "-1e400"),       # parse to inf
    ("{not json", "{not json"), ("", ""), ('"unterminated', '"unterminated'),
    # standard JSON a client can read parses
    ('"\\ud83d\\ude00"', "\U0001F600"), ("9" * 4000, int("9" * 4000)),
    ("[" * 60 + "]" * 60, json.loads("[" * 60 + "]" * 60)),
    ('{"x": [1, 2.5, null, true]}', {"x": [1, 2.5, None, True]}), ("-0.0", -0.0),
]


def _block(*params, name="f") -> str:
    body = "\n".join(f'<{D} parameter name="{k}" string="{s}">{v}</{D} parameter>' for k, s, v in params)
    return f"\n\n<{D} calls>\n<{D} invoke name=\"{name}\">\n{body}\n</{D} invoke>\n</{D} calls>"


def _strict(text: str):
    """json.loads that takes standard JSON only (no NaN/Infinity) and valid Unicode only."""
    def no(c):
        raise ValueError(f"non-standard JSON constant {c}")
    value = json.loads(text, parse_constant=no)
    text.encode("utf-8")
    json.dumps(value, allow_nan=False)
    return value


def _fields(answer: ChatAnswer, pieces) -> dict:
    out = {"reasoning_content": "", "content": "", "tool_calls": []}
    for d in [answer.feed(p) for p in pieces] + [answer.flush()]:
        for k in ("reasoning_content", "content"):
            out[k] += d.get(k, "")
        out["tool_calls"] += d.get("tool_calls", [])
    return out


def _checked(out: dict) -> dict:
    """Every call's arguments standard JSON; the answer as a client gets it standard JSON in UTF-8."""
    json.dumps(out, ensure_ascii=False, allow_nan=False).encode("utf-8")
    for c in out["tool_calls"]:
        assert isinstance(_strict(c["function"]["arguments"]), dict)
    return {**out, "tool_calls": [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]]}


def _every_split(text: str, thinking: bool = True) -> dict:
    """The answer whole, then in two pieces at every split point and one character at a time:
    all the same fields."""
    whole = _checked(_fields(ChatAnswer(thinking, True), [text]))
    for i in range(len(text) + 1):
        assert _checked(_fields(ChatAnswer(thinking, True), [text[:i], text[i:]])) == whole, i
    assert _checked(_fields(ChatAnswer(thinking, True), list(text))) == whole
    return whole


@pytest.mark.parametrize("written,kept", HOSTILE, ids=lambda v: repr(v)[:20] if isinstance(v, str) else None)
def test_a_value_json_cannot_carry_stays_its_text(written, kept):
    content, calls = tool_calls.split_tool_calls("x" + _block(("v", "false", written), ("s", "true", "ok")))
    assert content == "x" and len(calls) == 1
    assert _strict(calls[0]["function"]["arguments"]) == {"v": kept, "s": "ok"}


STREAMED = [w for w, _ in HOSTILE if len(w) < 200] + ["9" * 5000, "[" * 1000]   # every split: n^2 work


@pytest.mark.parametrize("written", STREAMED, ids=lambda v: repr(v)[:20])
def test_hostile_values_streamed_at_every_split_point(written):
    text = "think</think>Ok." + _block(("v", "false", written), ("n", "false", "2"))
    whole = _every_split(text)
    assert whole["reasoning_content"] == "think" and whole["content"] == "Ok."
    assert json.loads(whole["tool_calls"][0][1])["n"] == 2


def test_cut_answers_never_raise_and_stream_as_they_parse():
    """Every prefix of an answer with hostile values (max_tokens can cut anywhere), streamed at
    every split point of it, a reasoning marker and tags left open included."""
    text = ("<think>r</think>c" + _block(("a", "false", "NaN"), ("b", "false", '"\\ud800"'), ("c", "true", "<x>")) +
            _block(("d", "false", "[1]"), name="g"))
    for end in range(0, len(text) + 1, 7):
        _every_split(text[:end])


def test_a_megabyte_of_arguments():
    big = json.dumps({"data": "y" * (1 << 20), "n": [1.5] * 1000})
    text = "c" + _block(("big", "false", big), ("raw", "true", "z" * (1 << 20)), ("nan", "false", "[NaN]" * 1000))
    out = _checked(_fields(ChatAnswer(False, True), [text[i:i + 4096] for i in range(0, len(text), 4096)]))
    assert out["content"] == "c"
    args = _strict(out["tool_calls"][0][1])
    assert args == {"big": json.loads(big), "raw": "z" * (1 << 20), "nan": "[NaN]" * 1000}


class _Counted:
    """A compiled pattern that adds up the characters it is handed to scan."""

    def __init__(self, pattern: re.Pattern, counter: list):
        self.pattern, self.counter = pattern, counter

    def _span(self, string, pos=0, endpos=None):
        self.counter[0] += (len(string) if endpos is None else min(endpos, len(string))) - pos

    def __getattr__(self, name):
        method = getattr(self.pattern, name)
        if name in ("search", "match", "fullmatch", "findall", "finditer"):
            def counted(string, *args):
                self._span(string, *args)
                return method(string, *args)
            return counted
        if name in ("sub", "subn", "split"):
            def counted_sub(*args, **kw):
                self._span(args[1] if name != "split" else args[0])
                return method(*args, **kw)
            return counted_sub
        return method


def _work(monkeypatch, text: str, step: int, thinking: bool) -> int:
    """Characters the parsers' regular expressions scan for ``text`` streamed ``step`` at a time."""
    counter = [0]
    for module in (tool_calls, reasoning):
        for name, value in list(vars(module).items()):
            if isinstance(value, re.Pattern):
                monkeypatch.setattr(module, name, _Counted(value, counter))
    answer = ChatAnswer(thinking, True)
    for i in range(0, len(text), step):
        answer.feed(text[i:i + step])
    answer.flush()
    monkeypatch.undo()
    return counter[0]


SHAPES = {   # an answer of about n characters, each a way to make the parsers work
    "one long string value": lambda n: "ok" + _block(("a", "true", "x" * n)),
    "one long JSON value": lambda n: "ok" + _block(("a", "false", json.dumps(["ab"] * (n // 6)))),
    "many parameters": lambda n: "ok" + _block(*[(f"p{i}", "false", str(i)) for i in range(n // 60)]),
    "deep nesting": lambda n: "ok" + _block(("a", "false", "[" * (n // 2) + "]" * (n // 2))),
    "a tag never closed": lambda n: f"ok\n\n<{D} calls>\n<{D} invoke name=\"" + "n" * n,
    "a parameter never closed": lambda n: ("ok" + _block(("a", "true", "v"))[:-40]
                                           + f'<{D} parameter name="b" string="true">' + "v" * n),
    "blank lines": lambda n: "ok" + "\n" * n + "end",
    "tag starts": lambda n: f"<{D} calls><{D} invoke name=\"f\">" + f"<{D}" * (n // 8),
    "long reasoning": lambda n: "r" * n + "</think>c",
}


@pytest.mark.parametrize("shape", SHAPES)
def test_parsing_is_linear_in_the_answer(monkeypatch, shape):
    """Streamed 4 characters at a time (200 KB of arguments used to cost minutes of CPU), the
    characters scanned for an answer 4 times as long are at most ~4 times as many."""
    n = 20_000
    small, large = (_work(monkeypatch, SHAPES[shape](m), 4, shape == "long reasoning") for m in (n, 4 * n))
    assert small > 0
    assert large <= 4.5 * small, (shape, small, large)
