"""The reasoning and tool-call parsers against answers the encoder writes (an assistant turn of
``checkpoint/chat.py``, which renders what the parsers must take apart) and against answers
written here by hand; streamed in any chunking, the deltas add up to the whole answer."""
import json
import random

import pytest

from dsv41.checkpoint.chat import ASSISTANT, EOS, THINK, encode_messages
from dsv41.serving.chat_answer import ChatAnswer
from dsv41.serving.reasoning import split_reasoning
from dsv41.serving.tool_calls import split_tool_calls

D = "｜DSML｜"
CALLS = [{"id": "a", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Paris", "days": 2, "units": None}}},
         {"id": "b", "type": "function", "function": {"name": "lookup",
                                                      "arguments": {"q": "a \"quoted\" </tag>", "n": [1, 2]}}}]
TOOLS = [{"type": "function", "function": {"name": "get_weather"}},
         {"type": "function", "function": {"name": "lookup"}}]


def _answer(variant: str, reasoning: str, content: str, calls=None) -> str:
    """The text an assistant turn has in the encoder's rendering (between the generation prompt's
    <think> and EOS): what the model is trained to write."""
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        turn["tool_calls"] = calls
    text = encode_messages([{"role": "user", "content": "q"}, turn], thinking=True, tools=TOOLS if calls else None,
                           variant=variant, add_generation_prompt=False)
    return text.rsplit(ASSISTANT + THINK, 1)[1].removesuffix(EOS)


def _streamed(answer: ChatAnswer, text: str, seed: int) -> dict:
    """Feed the text in random pieces; join the deltas as a client does."""
    rng, i, out = random.Random(seed), 0, {"reasoning_content": "", "content": "", "tool_calls": []}
    deltas = []
    while i < len(text):
        n = rng.randint(1, 7)
        deltas.append(answer.feed(text[i:i + n]))
        i += n
    deltas.append(answer.flush())
    for d in deltas:
        out["reasoning_content"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        out["tool_calls"] += d.get("tool_calls", [])
    return out


def _args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("variant", ["v4", "v4.1"])
def test_encoder_answers_parse_back_to_the_message(variant):
    text = _answer(variant, "Check the weather first.", "Let me look.", CALLS)
    msg = ChatAnswer(thinking=True, tools=True).message(text)
    assert msg["reasoning_content"] == "Check the weather first." and msg["content"] == "Let me look."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "lookup"]
    assert [_args(c) for c in msg["tool_calls"]] == [c["function"]["arguments"] for c in CALLS]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg["tool_calls"])
    for seed in range(20):
        s = _streamed(ChatAnswer(thinking=True, tools=True), text, seed)
        assert (s["reasoning_content"], s["content"]) == ("Check the weather first.", "Let me look.")
        assert [c["index"] for c in s["tool_calls"]] == [0, 1]
        assert [_args(c) for c in s["tool_calls"]] == [_args(c) for c in msg["tool_calls"]]


@pytest.mark.parametrize("variant", ["v4", "v4.1"])
def test_answer_without_calls_keeps_its_content(variant):
    text = _answer(variant, "think", "The answer is 4.\n\nDone.")
    a = ChatAnswer(thinking=True, tools=True)
    assert a.message(text) == {"role": "assistant", "content": "The answer is 4.\n\nDone.",
                               "reasoning_content": "think", "reasoning": "think"}
    assert a.finish_reason("stop") == "stop"
    assert _streamed(ChatAnswer(True, True), text, 1)["content"] == "The answer is 4.\n\nDone."


def test_reasoning_by_hand():
    assert split_reasoning("a</think>b") == ("a", "b")
    assert split_reasoning("<think>a</think>b") == ("a", "b")         # a repeated opening is dropped
    assert split_reasoning("cut by max_tokens") == ("cut by max_tokens", "")
    assert split_reasoning("a</think>b</think>c") == ("a", "b</think>c")
    assert split_reasoning("</thin") == ("</thin", "")                 # not the marker: reasoning text
    assert split_reasoning("<think>") == ("", "")
    # non-thinking mode: no reasoning parser, the text is the content
    assert ChatAnswer(thinking=False, tools=False).message("a</think>b") == {"role": "assistant",
                                                                              "content": "a</think>b"}


def test_tool_calls_by_hand():
    text = (f"Sure.\n\n<{D} calls>\n<{D} invoke name=\"add\">\n"
            f"<{D} parameter name=\"a\" string=\"false\">1.5</{D} parameter>\n"
            f"<{D} parameter name=\"b\" string=\"false\">not json</{D} parameter>\n"
            f"<{D} parameter name=\"s\" string=\"true\">{{\"x\": 1}}</{D} parameter>\n</{D} invoke>\n</{D} calls>")
    content, calls = split_tool_calls(text)
    assert content == "Sure." and len(calls) == 1
    assert calls[0]["function"]["name"] == "add"
    assert _args(calls[0]) == {"a": 1.5, "b": "not json", "s": "{\"x\": 1}"}   # string="true" stays text
    a = ChatAnswer(thinking=False, tools=True)
    msg = a.message(text)
    assert msg["content"] == "Sure." and a.finish_reason("stop") == "tool_calls"
    # only a call, no content: content is null
    assert ChatAnswer(False, True).message(text.removeprefix("Sure."))["content"] is None
    # a block in which nothing parses stays the content it was
    broken = f"x <{D} calls>\n<{D} invoke oops>\n</{D} calls>"
    assert split_tool_calls(broken) == (broken, [])
    # cut off inside the block (max_tokens) before a call closed: the text as it was
    cut = text[:text.index("</" + D + " invoke>")]
    assert split_tool_calls(cut) == (cut, [])
    # no tools offered: DSML text is content
    assert ChatAnswer(False, False).message(text)["content"] == text


def test_parsers_hold_back_a_marker_split_across_deltas():
    a = ChatAnswer(thinking=True, tools=True)
    parts = ["reason", "</th", "ink>", "ok", "\n", "\n<", D, " ca", "lls>\n<", D, " invoke name=\"f\">\n</", D,
             " invoke>", "\n</", D, " calls>"]
    deltas = [a.feed(p) for p in parts] + [a.flush()]
    assert deltas[1] == {} and deltas[2] == {}            # "</th" could still be </think>
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "reason"
    assert "".join(d.get("content", "") for d in deltas) == "ok"     # the blank lines before the block dropped
    called = [d for d in deltas if "tool_calls" in d]
    assert len(called) == 1 and called[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_developer_role_is_a_user_turn_and_effort_is_stated():
    dev = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    user = [{"role": "user", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for v in ("v4", "v4.1"):      # a turn of its own (two user messages are one turn)
        assert encode_messages(dev, variant=v) == "<｜begin▁of▁sentence｜><｜User｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"
        assert encode_messages(user, variant=v) == "<｜begin▁of▁sentence｜><｜User｜>Be brief.\n\nHi<｜Assistant｜></think>"
    text = encode_messages(user[1:], thinking=True, variant="v4.1", effort=80)
    assert text.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 80 (range 1-100")
    assert encode_messages(user[1:], thinking=True, variant="v4.1", effort=None) == \
        encode_messages(user[1:], thinking=True, variant="v4.1", effort=50)
    assert "Reasoning Effort" not in encode_messages(user[1:], thinking=False, variant="v4.1", effort=80)
    with pytest.raises(ValueError, match=r"^reasoning_effort: expected one of 'low', .* or an integer in \[1, 100\]"):
        encode_messages(user, thinking=True, variant="v4.1", effort=101)
    with pytest.raises(ValueError, match="^reasoning_effort: the V4 format"):
        encode_messages(user, thinking=True, variant="v4", effort=50)
