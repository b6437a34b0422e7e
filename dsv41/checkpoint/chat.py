"""The DeepSeek-V4 / V4.1 chat encoding: messages in, prompt text (or token ids) out.

The V4 releases ship no Jinja ``chat_template``; chats are rendered by the ``encoding/`` script
in the model folder. This module implements that format from its published rules:

- the prompt opens with BOS; a user turn is ``<｜User｜>`` + text; the generation prompt after the
  last user turn is ``<｜Assistant｜>`` + ``<think>`` (thinking) or ``</think>`` (non-thinking);
- an assistant turn is [reasoning + ``</think>``] + content + [tool calls] + EOS, where the
  reasoning part appears only in thinking mode and, when reasoning is dropped from history, only
  for assistant turns after the last user turn (earlier turns then follow ``</think>``);
- reasoning is dropped from history in thinking mode unless tools are offered;
- tool results have no role of their own: runs of tool/user messages form one user turn whose
  parts are joined by a blank line, each result wrapped in ``<tool_result>...</tool_result>`` and
  ordered as the preceding assistant's calls;
- tools are described in the system prompt, tool calls are written in DSML tags.

V4.1 differs in four places: system text follows ``<｜System｜>`` (and a system message after the
first counts as a user turn), the DSML tag names carry a leading space (`` calls``, `` invoke``,
`` parameter``), tool-call arguments must be a JSON object, and thinking mode states a reasoning
effort at the start (an integer on its 1-100 scale, or a name: "low" 25, "high" 50 - the default -,
"xhigh" 75, "max" 100). V4 knows two efforts: "high" (its default, stated nowhere) and "max",
which opens a thinking prompt with a paragraph asking for the most thorough reasoning.

A ``developer`` message (what current OpenAI clients send in place of ``system``) is a user turn
of its own, as DeepSeek's reference encoder renders it: ``<｜User｜>`` and its text, never merged
with the user or tool messages around it; it is answered like a user turn, and in thinking mode
(with no tools on offer, where earlier reasoning is dropped) developer messages before the last
user turn are dropped with it.

DeepSeek's own message fields, as its reference encoders render them: a ``latest_reminder``
message (``<｜latest_reminder｜>`` and its text: context such as the date and place, never
answered itself, though a user turn right before it is); ``tools`` on a system or developer
message (described after that message's text, where the request's ``tools`` go into the first
system prompt); and a user or developer message's ``task``, one of its classification tasks
(``TASKS``): the answer that follows is that task's, with no reasoning, opened by the task's token
(``action`` after an assistant turn's opening, the others in its place). Their control tokens are
in the released tokenizers but not required of a checkpoint (``CONTROLS``): a chat that uses one
on a tokenizer without it is refused naming the token.

Only the encoder inserts control tokens: :class:`ChatTokenizer` turns the encoder's control
pieces into their single ids and encodes all other text with the tokenizer's added tokens
switched off, so a user who types ``<｜User｜>`` or ``<think>`` gets those characters, not a turn
boundary.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from dsv41.checkpoint.plain import plain_tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"

LATEST_REMINDER = "<｜latest_reminder｜>"
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
# DeepSeek's classification tasks and their tokens
TASKS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>", "domain": "<｜domain｜>",
         "title": "<｜title｜>", "read_url": "<｜read_url｜>"}
EFFORT_RANGE = (1, 100)         # V4.1's reasoning-effort scale
DEFAULT_EFFORT = 50             # V4.1's default ("high")
EFFORT_NAMES = {"low": 25, "high": 50, "xhigh": 75, "max": 100}    # V4.1's named efforts on that scale
# V4's "max" effort: what its thinking prompt opens with (byte for byte as the model was trained)
V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


@dataclass(frozen=True)
class Control:
    """A control token the encoder placed; its text never passes through the BPE."""
    text: str


@dataclass(frozen=True)
class _Variant:
    system_token: bool          # system text follows <｜System｜>; later systems act as user turns
    calls: str                  # DSML block name around the tool calls
    invoke: str
    parameter: str
    states_effort: bool         # thinking mode opens with the reasoning effort
    arguments_must_be_object: bool

    def effort_prefix(self, effort: int | str | None) -> str:
        """What a thinking prompt opens with, for a checked effort (``stated_effort``)."""
        if not self.states_effort:
            return V4_MAX_EFFORT if effort == "max" else ""
        return (f"Reasoning Effort: {DEFAULT_EFFORT if effort is None else effort} "
                "(range 1-100, the higher the value, the more thorough the reasoning)\n\n")


VARIANTS = {
    "v4": _Variant(False, "tool_calls", "invoke", "parameter", False, False),
    "v4.1": _Variant(True, " calls", " invoke", " parameter", True, True),
}
# the control tokens each variant's prompts and answers use
CONTROLS = {"v4": (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML),
            "v4.1": (BOS, EOS, USER, ASSISTANT, SYSTEM, THINK, END_THINK, DSML)}

# every control token the encoder may place: CONTROLS and those only DeepSeek's own fields use
ALL_CONTROLS = tuple(dict.fromkeys([*(t for tokens in CONTROLS.values() for t in tokens), LATEST_REMINDER,
                                    *TASKS.values()]))

# The tools section of the system prompt, as the model was trained on it (byte for byte).
# {D} {T} {E}: the DSML, <think> and </think> control tokens; {C} {I} {P}: the variant's DSML
# calls / invoke / parameter tag names; {SCHEMAS}: one JSON function schema a line.
_TOOLS = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    "by writing a \"<{D}{C}>\" block like the following:\n\n"
    "<{D}{C}>\n"
    "<{D}{I} name=\"$TOOL_NAME\">\n"
    "<{D}{P} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{D}{P}>\n"
    "...\n"
    "</{D}{I}>\n"
    "<{D}{I} name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</{D}{I}>\n"
    "</{D}{C}>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by {T}), you MUST output your complete reasoning "
    "inside {T}...{E} BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after {E} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{SCHEMAS}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n")


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class _Out:
    """Pieces of the prompt: plain strings (text) and Control tokens, adjacent text merged."""

    def __init__(self):
        self.pieces: list[str | Control] = []

    def text(self, s: str):
        if not s:
            return
        if self.pieces and isinstance(self.pieces[-1], str):
            self.pieces[-1] += s
        else:
            self.pieces.append(s)

    def control(self, token: str):
        self.pieces.append(Control(token))


# ---------------------------------------------------------------- validation


def _text_of(value, field: str) -> str:
    """Message text: a string, or a list of {"type": "text", "text": str} parts (blank-line joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"{field}[{i}]: expected a text part "
                                 f"{{'type': 'text', 'text': str}}, found {part!r}")
            parts.append(part["text"])
        return "\n\n".join(parts)
    raise ValueError(f"{field}: expected a string or a list of text parts, "
                     f"found {type(value).__name__}")


def _arguments(call: dict, field: str, must_be_object: bool) -> dict:
    raw = call.get("arguments")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}.arguments: expected JSON, found {raw!r} ({e})") from None
    if isinstance(raw, dict):
        return raw
    if must_be_object or raw is not None:
        raise ValueError(f"{field}.arguments: expected a JSON object, found {raw!r}")
    raise ValueError(f"{field}.arguments: missing")


def _tool_calls(calls, field: str, variant: _Variant) -> list[tuple[str, dict, str | None]]:
    if not isinstance(calls, list):
        raise ValueError(f"{field}: expected a list, found {type(calls).__name__}")
    out = []
    for i, call in enumerate(calls):
        f = f"{field}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError(f"{f}.function: expected an object with name and arguments, "
                             f"found {fn!r}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{f}.function.name: expected a non-empty string, "
                             f"found {fn.get('name')!r}")
        out.append((fn["name"], _arguments(fn, f + ".function", variant.arguments_must_be_object),
                    call.get("id")))
    return out


def _tool_schemas(tools, field: str = "tools") -> list[dict]:
    if not isinstance(tools, list):
        raise ValueError(f"{field}: expected a list, found {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{field}[{i}].function: expected an object with a name, found {fn!r}")
        out.append(fn)
    return out


@dataclass
class _Turn:
    role: str                      # system / developer / user / assistant / latest_reminder (tool results live
    text: str = ""                 # in user turns); system, developer, latest_reminder: the text
    parts: list | None = None      # user: [("text", s) | ("tool", s, call_id)]
    content: str = ""              # assistant
    reasoning: str = ""
    calls: list | None = None
    tools: list | None = None      # system, developer: the tools described after the text
    task: str | None = None        # user, developer: the classification task answered next


def _turns(messages, variant: _Variant) -> list[_Turn]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: expected a non-empty list, found {messages!r}")
    turns: list[_Turn] = []
    for i, msg in enumerate(messages):
        f = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{f}: expected an object, found {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{f}.role: expected one of {', '.join(ROLES)}, found {role!r}")
        _check_name(msg.get("name"), f + ".name")
        if msg.get("prefix") not in (None, False):
            raise ValueError(f"{f}.prefix: continuing an assistant message (DeepSeek's chat prefix completion) "
                             f"is not served; expected false or no prefix, found {msg['prefix']!r}")
        task = _task(msg.get("task"), role, f + ".task")
        tools = msg.get("tools")
        if tools is not None and role not in ("system", "developer"):
            raise ValueError(f"{f}.tools: only a system or developer message describes tools (a {role} message "
                             f"has none)")
        if role == "assistant":
            calls = msg.get("tool_calls")
            calls = _tool_calls(calls, f + ".tool_calls", variant) if calls else []
            content = msg.get("content")
            if content is None and not calls:
                raise ValueError(f"{f}.content: missing (an assistant message needs content "
                                 f"or tool_calls)")
            reasoning = msg.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{f}.reasoning_content: expected a string, "
                                 f"found {type(reasoning).__name__}")
            turns.append(_Turn("assistant", content=_text_of(content, f + ".content")
                               if content is not None else "",
                               reasoning=reasoning or "", calls=calls))
            continue
        if "content" not in msg or msg["content"] is None:
            raise ValueError(f"{f}.content: missing")
        text = _text_of(msg["content"], f + ".content")
        if role in ("system", "developer", "latest_reminder"):       # a turn of its own, never merged
            turns.append(_Turn(role, text=text, tools=_tool_schemas(tools, f + ".tools") if tools else None,
                               task=task))
            continue
        part = ("tool", text, msg.get("tool_call_id")) if role == "tool" else ("text", text)
        # a run of user / tool messages is one user turn (a user message after a task's turn opens its own)
        if turns and turns[-1].role == "user" and (role == "tool" or turns[-1].task is None):
            if task is not None:
                raise ValueError(f"{f}.task: this message joins the user turn before it, and a task is the "
                                 f"answer to a turn of its own; put the task on that turn's first message")
            turns[-1].parts.append(part)
        else:
            turns.append(_Turn("user", parts=[part], task=task))
    return turns


def _task(task, role: str, field: str) -> str | None:
    if task is None:
        return None
    if role not in ("user", "developer"):
        raise ValueError(f"{field}: only a user or developer message takes a task, found one on a {role} message")
    if task not in TASKS:
        raise ValueError(f"{field}: expected one of {', '.join(TASKS)}, found {task!r}")
    return task


def _check_name(name, field: str):
    """A message's ``name`` (OpenAI's participant name): the DeepSeek encodings do not render it,
    and a template writes it as text, so it may not spell a control token."""
    if name is None:
        return
    if not isinstance(name, str):
        raise ValueError(f"{field}: expected a string, found {type(name).__name__}")
    found = next((c for c in ALL_CONTROLS if c in name), None)
    if found is not None:
        raise ValueError(f"{field}: holds the control token {found!r}; only message content may carry that text")


def check_messages(messages, tools=None) -> None:
    """The OpenAI chat schema this encoding takes (ValueError naming the field): any renderer,
    a Jinja template included, sees only messages that pass it."""
    _turns(messages, VARIANTS["v4"])
    if tools is not None:
        _tool_schemas(tools)


def _order_results(turns: list[_Turn]):
    """Tool results in a user turn follow the order of the preceding assistant's calls."""
    order: dict = {}
    for turn in turns:
        if turn.role == "assistant" and turn.calls:
            order = {cid: k for k, (_, _, cid) in enumerate(turn.calls) if cid}
        elif turn.role == "user" and order:
            results = [p for p in turn.parts if p[0] == "tool"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda p: order.get(p[2], 0)))
                turn.parts = [next(ranked) if p[0] == "tool" else p for p in turn.parts]


# ---------------------------------------------------------------- rendering


def _is_user_turn(turn: _Turn, index: int, variant: _Variant) -> bool:
    return turn.role in ("user", "developer") or (variant.system_token and turn.role == "system" and index > 0)


def _render_tools(out: _Out, schemas: list[dict], variant: _Variant):
    controls = dict(D=DSML, T=THINK, E=END_THINK)
    fills = dict(C=variant.calls, I=variant.invoke, P=variant.parameter,
                 SCHEMAS="\n".join(_json(s) for s in schemas))
    for k, piece in enumerate(re.split(r"\{([A-Z]+)\}", _TOOLS)):
        if k % 2 == 0:
            out.text(piece)
        elif piece in controls:
            out.control(controls[piece])
        else:
            out.text(fills[piece])


def _render_calls(out: _Out, calls, variant: _Variant):
    out.text("\n\n<")
    out.control(DSML)
    out.text(variant.calls + ">\n")
    for k, (name, args, _) in enumerate(calls):
        if k:
            out.text("\n")
        out.text("<")
        out.control(DSML)
        out.text(f'{variant.invoke} name="{name}">\n')
        for j, (key, value) in enumerate(args.items()):
            if j:
                out.text("\n")
            is_str = isinstance(value, str)
            out.text("<")
            out.control(DSML)
            out.text(f'{variant.parameter} name="{key}" string="{"true" if is_str else "false"}">'
                     + (value if is_str else _json(value)) + "</")
            out.control(DSML)
            out.text(variant.parameter + ">")
        out.text("\n</")
        out.control(DSML)
        out.text(variant.invoke + ">")
    out.text("\n</")
    out.control(DSML)
    out.text(variant.calls + ">")


def stated_effort(effort, variant: str) -> int | str | None:
    """The effort as the variant states it: V4.1 a number on its scale (a name mapped), V4 its
    name ("high": None, stated nowhere); ValueError naming reasoning_effort for any other."""
    v = VARIANTS[variant]
    if effort is None:
        return None
    if not v.states_effort:
        if effort not in ("high", "max"):
            raise ValueError(f"reasoning_effort: the V4 format has \"high\" and \"max\", found {effort!r}")
        return None if effort == "high" else effort
    low, high = EFFORT_RANGE
    if isinstance(effort, str) and effort in EFFORT_NAMES:
        return EFFORT_NAMES[effort]
    if isinstance(effort, bool) or not isinstance(effort, int) or not low <= effort <= high:
        raise ValueError(f"reasoning_effort: expected one of {', '.join(map(repr, EFFORT_NAMES))} or an "
                         f"integer in [{low}, {high}], found {effort!r}")
    return effort


def chat_pieces(messages, thinking: bool = False, add_generation_prompt: bool = True,
                tools=None, variant: str = "v4", effort: int | str | None = None) -> list[str | Control]:
    """The prompt as pieces: ``Control`` tokens the format places, and text (str) between them.
    effort: the reasoning effort in thinking mode (None: the format's default, "high")."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}, found {variant!r}")
    v = VARIANTS[variant]
    effort = stated_effort(effort, variant)    # checked in chat mode too, as the reference does
    prefix = v.effort_prefix(effort) if thinking else ""
    turns = _turns(messages, v)
    schemas = _tool_schemas(tools) if tools else []
    if schemas:  # request tools are described in the (first) system prompt
        if turns[0].role != "system":
            turns.insert(0, _Turn("system", text=""))
        turns[0].tools = [*schemas, *(turns[0].tools or ())]
    _order_results(turns)
    # with tools on offer, reasoning stays in history (the calls of a turn depend on it)
    drop = thinking and not any(t.tools for t in turns)
    last_user = max((i for i, t in enumerate(turns) if _is_user_turn(t, i, v)), default=-1)
    if drop:       # developer turns go with the reasoning they framed
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]
        last_user = max((i for i, t in enumerate(turns) if _is_user_turn(t, i, v)), default=-1)

    out = _Out()
    out.control(BOS)
    for i, turn in enumerate(turns):
        if i == 0 and (turn.role == "system" or prefix) and v.system_token:
            out.control(SYSTEM)
        if i == 0:
            out.text(prefix)
        if turn.role in ("system", "developer"):
            if turn.role == "developer":
                out.control(USER)
            elif i > 0 and v.system_token:
                out.control(SYSTEM)
            out.text(turn.text)
            if turn.tools:
                out.text("\n\n")
                _render_tools(out, turn.tools, v)
        elif turn.role == "latest_reminder":
            out.control(LATEST_REMINDER)
            out.text(turn.text)
        elif turn.role == "user":
            out.control(USER)
            out.text("\n\n".join(p[1] if p[0] == "text" else f"<tool_result>{p[1]}</tool_result>"
                                 for p in turn.parts))
        else:      # an assistant turn; one answering a task has no reasoning
            if thinking and (not drop or i > last_user) and not (i and turns[i - 1].task):
                out.text(turn.reasoning)
                out.control(END_THINK)
            out.text(turn.content)
            if turn.calls:
                _render_calls(out, turn.calls, v)
            out.control(EOS)
        following = turns[i + 1].role if i + 1 < len(turns) else None
        # what opens the answer: after the last turn, or before an assistant turn or a reminder
        if not (following in ("assistant", "latest_reminder") or (following is None and add_generation_prompt)):
            continue
        if turn.task == "action":
            out.control(ASSISTANT)
            out.control(THINK if thinking else END_THINK)
            out.control(TASKS["action"])
        elif turn.task is not None:
            out.control(TASKS[turn.task])
        elif _is_user_turn(turn, i, v):
            out.control(ASSISTANT)
            out.control(THINK if thinking and (not drop or i >= last_user) else END_THINK)
    return out.pieces


def encode_messages(messages, thinking: bool = False, add_generation_prompt: bool = True,
                    tools=None, variant: str = "v4", effort: int | str | None = None) -> str:
    """The prompt text of a chat (thinking or non-thinking mode)."""
    return "".join(p.text if isinstance(p, Control) else p
                   for p in chat_pieces(messages, thinking, add_generation_prompt, tools, variant, effort))


class ChatTokenizer:
    """Token ids of a chat: control pieces as their single ids, all other text through a copy of
    the tokenizer that has no added tokens (``plain.plain_tokenizer``), so text can never become a
    control token."""

    def __init__(self, tokenizer, plain=None):
        """plain: the tokenizer's copy without added tokens when the caller already made one."""
        self.tokenizer = tokenizer
        self.plain = plain_tokenizer(tokenizer) if plain is None else plain

    def control_id(self, token: str) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None and (token == LATEST_REMINDER or token in TASKS.values()):
            raise ValueError(f"messages: this checkpoint's tokenizer has no {token!r}, the token DeepSeek's "
                             f"latest_reminder messages and tasks are written with")
        if tid is None:
            raise ValueError(f"tokenizer: expected the control token {token!r} in its vocabulary, "
                             f"found none (is the chat variant right for this checkpoint?)")
        return tid

    def encode_text(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it runs (encode does not): a long message does
        # not stall the server's other threads
        return self.plain.encode_batch([text], add_special_tokens=False)[0].ids

    def encode(self, messages, thinking: bool = False, add_generation_prompt: bool = True,
               tools=None, variant: str = "v4", effort: int | str | None = None,
               allow_special: bool = False) -> list[int]:
        """allow_special: the messages' text is parsed for control tokens too (--allow-special-tokens)."""
        text = (lambda s: self.tokenizer.encode(s, add_special_tokens=False).ids) if allow_special \
            else self.encode_text
        ids: list[int] = []
        for piece in chat_pieces(messages, thinking, add_generation_prompt, tools, variant, effort):
            ids += [self.control_id(piece.text)] if isinstance(piece, Control) else text(piece)
        return ids
