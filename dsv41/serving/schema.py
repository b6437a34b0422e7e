"""OpenAI request bodies checked before anything reaches the engine, and the response bodies.

Every refusal is an ``ApiError``: an HTTP status and OpenAI's error object, whose ``param`` names
the field. The ranges are ``SamplingParams``' own (its messages start with the field's name).
Without a tokenizer (no ``--checkpoint``) prompts are token ids (``"prompt": [ints]``) and the
answers carry ``token_ids`` (their ``text`` is empty); chat, text prompts and stop strings need
the checkpoint's tokenizer.

No field is taken and ignored: each field of a body is one this endpoint serves (``SERVED``), one
that identifies the caller and has no effect on the answer (``IDENTIFIERS``, as in vLLM), or it is
refused with a 400 naming it (``REFUSED``: what its value would ask for is not implemented; an
unknown name likewise).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

from dsv41.checkpoint.chat import DEFAULT_EFFORT, DSML, END_THINK, VARIANTS, stated_effort
from dsv41.engine.grammar import Constraint
from dsv41.ops.sampling import SamplingParams
from dsv41.serving import structured

# body fields that go straight to SamplingParams (same names)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos", "include_stop_str_in_output")
# vLLM's own fields (its extra sampling, tokenizer and structured-output parameters)
VLLM_FIELDS = ("skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "priority",
               "response_format", "structured_outputs", *structured.GUIDED, "cache_salt", "request_id", "bad_words",
               "allowed_token_ids", "add_special_tokens", "use_beam_search", "return_token_ids",
               "return_tokens_as_token_ids", "prompt_logprobs", "thinking_token_budget")
_BOTH = ("model", "stream", "stream_options", "n", "max_tokens", "stop", "logit_bias", *SAMPLING_FIELDS,
         *VLLM_FIELDS)
SERVED = {
    False: frozenset(_BOTH + ("prompt", "logprobs", "echo", "best_of", "suffix")),
    True: frozenset(_BOTH + ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                             "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs",
                             "add_generation_prompt", "continue_final_message", "modalities", "store",
                             "echo", "enable_thinking")),
}
IDENTIFIERS = ("user", "safety_identifier", "prompt_cache_key")
REFUSED = {      # OpenAI chat fields whose every value asks for what this server does not do
    "audio": "audio output is not served", "functions": "the legacy functions API is not served; use tools",
    "function_call": "the legacy functions API is not served; use tool_choice", "metadata": "nothing is stored",
    "moderation": "moderation is not served", "prediction": "predicted outputs are not served",
    "prompt_cache_options": "there is no prompt cache", "prompt_cache_retention": "there is no prompt cache",
    "service_tier": "there is one service tier", "verbosity": "verbosity is not served",
    "web_search_options": "web search is not served",
}
CHAT_KWARGS = ("thinking", "enable_thinking", "reasoning_effort")   # what the DeepSeek encoding takes
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
DEFAULT_TEMPERATURE = 1.0          # OpenAI's default; send 0 for greedy
DEFAULT_COMPLETION_TOKENS = 16     # OpenAI's default for /v1/completions
MAX_DEPTH = 32                     # nesting of a body's arrays and objects (the deepest OpenAI field is ~6)
SHOWN_CHARS = 80                   # a refused value is quoted up to this many characters
MAX_MESSAGE_CHARS = 1000           # an error message's length
MAX_N = 16                         # parallel samples of one request (each runs as its own request)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        if len(message) > MAX_MESSAGE_CHARS:     # messages quote what was refused, which can be megabytes
            message = message[:MAX_MESSAGE_CHARS] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param)


@dataclass(frozen=True)
class Limits:
    """What the served engine takes: a request's context, a prompt's tokens, the vocabulary."""
    max_context: int
    max_prompt: int
    vocab_size: int
    max_body_bytes: int
    require_cache_salt: bool = False   # every request names its tenant's cache_salt (--require-cache-salt)


@dataclass
class Generation:
    """A checked request: prompt ids, sampling settings, and how to answer."""
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    top_logprobs: int | None       # None: no logprobs asked
    thinking: bool = False         # chat: split reasoning_content off the answer
    tool_calls: bool = False       # chat: parse tool calls out of the answer
    n: int = 1                     # samples, each its own request (sample i seeded seed + i, as vLLM)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None  # vLLM's: its prompt shares cached spans only with prompts of the same salt
    constraint: tuple | None = None  # structured output: (field, kind, text) to compile (``constrained``)
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every streamed chunk carries the usage so far
    request_id: str | None = None  # vLLM's request_id: the answer's id after its prefix (None: a random one)
    echo: str = ""                 # chat echo: the last message's text the answer starts with
    token_ids: bool = False        # vLLM's return_token_ids: the prompt's and each choice's ids too
    tokens_as_ids: bool = False    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"

    def samples(self) -> list[SamplingParams]:
        """The settings of each of the n samples."""
        p = self.params
        return [p if p.seed is None or i == 0 else replace(p, seed=p.seed + i) for i in range(self.n)]


def shown(value) -> str:
    """A refused value for an error message: its repr, cut short (a body can hold megabytes)."""
    if isinstance(value, int) and value.bit_length() >= 256:
        return f"<a {value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _check_tree(body) -> None:
    """Every value of a parsed body: nested at most MAX_DEPTH deep, strings valid Unicode (JSON's
    \\ud800 escapes decode to lone surrogates, which no tokenizer or encoder takes). Iterative, so
    the check itself cannot overflow the stack."""
    todo = [(body, "body", 0)]
    while todo:
        value, where, depth = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"a lone surrogate (U+{ord(value[e.start]):04X}) at character {e.start} is not text",
                          where) from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH} arrays/objects", where.split(".")[0].split("[")[0])
        if isinstance(value, list):
            todo += [(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
            continue
        for key, item in value.items():
            child = key if where == "body" else f"{where}.{key}"
            todo += [(key, child, depth + 1), (item, child, depth + 1)]


def parse_body(raw: bytes, limits: Limits) -> dict:
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"body: {len(raw)} bytes is over the limit of {limits.max_body_bytes}", "body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"expected UTF-8, found byte 0x{raw[e.start]:02x} at offset {e.start}", "body") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"expected JSON, found: {e}", "body") from None
    except RecursionError:
        raise bad(f"nested deeper than {MAX_DEPTH} arrays/objects", "body") from None
    except ValueError as e:               # an integer past Python's digit limit for int()
        raise bad(f"expected JSON this server can read: {e}", "body") from None
    if not isinstance(body, dict):
        raise bad(f"expected a JSON object, found {type(body).__name__}", "body")
    _check_tree(body)
    return body


def check_model(body: dict, served: str):
    """``model`` may be left out (as vLLM allows: the served model answers), else must name it."""
    if body.get("model") is None:
        return
    if body["model"] != served:
        raise ApiError(404, f"model: {shown(body['model'])} is not served here; the model is {served!r}", "model",
                       code="model_not_found")


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"expected true or false, found {shown(value)}", name)
    return value


def _int(body: dict, name: str, default, low: int, high: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"expected an integer, found {shown(value)}", name)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise bad(f"expected an integer in {bound}, found {shown(value)}", name)
    return value


def _token_ids(value, name: str, vocab: int) -> list[int]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad("expected a non-empty list of token ids", name)
    out_of_range = [t for t in value if not 0 <= t < vocab]
    if out_of_range:
        raise bad(f"token ids must be in [0, {vocab - 1}], found {shown(out_of_range[0])}", name)
    return list(value)


def completion_prompt(body: dict, codec, limits: Limits) -> list[int]:
    if "prompt" not in body:
        raise bad("missing", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]               # a batch of one
    if isinstance(prompt, str):
        if codec is None:
            raise bad("this server has no tokenizer (started without --checkpoint): send token ids, "
                      "\"prompt\": [ints]", "prompt")
        if not prompt:
            raise bad("expected a non-empty string", "prompt")
        # vLLM's add_special_tokens (default true here): the tokenizer's BOS before the text
        return codec.encode(prompt) if _flag(body, "add_special_tokens", True) else codec.encode_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"one prompt per request, found {len(prompt)}", "prompt")
    if not isinstance(prompt, list):
        raise bad(f"expected a string or a list of token ids, found {type(prompt).__name__}", "prompt")
    return _token_ids(prompt, "prompt", limits.vocab_size)


def check_fields(body: dict, chat: bool):
    """Every field is served, an identifier, or refused naming it."""
    for name, value in body.items():
        if name in IDENTIFIERS:
            if value is not None and not isinstance(value, str):
                raise bad(f"expected a string, found {value!r}", name)
        elif name in REFUSED and chat:
            if value is not None:             # null: the field left unset
                raise bad(f"not served: {REFUSED[name]}", name)
        elif name not in SERVED[chat]:
            where = "/v1/chat/completions" if chat else "/v1/completions"
            raise bad(f"not a field {where} takes", name)
    if _flag(body, "use_beam_search"):
        raise bad("beam search is not served (greedy and sampled decoding are); send false or leave it out",
                  "use_beam_search")
    if body.get("prompt_logprobs") is not None:
        raise bad("not served: the head computes logits only at the rows that draw a token, never at a "
                  "prompt's earlier rows", "prompt_logprobs")
    if chat:
        _check_chat_only(body)
    else:
        if _flag(body, "echo"):
            raise bad("not served: echoing the prompt on /v1/completions comes with its logprobs (vLLM's "
                      "prompt_logprobs), which are not served", "echo")
        if _int(body, "best_of", 1, 1) != 1:
            raise bad("only best_of = 1 is served", "best_of")
        if body.get("suffix") not in (None, ""):
            raise bad("insertion (a suffix after the answer) is not served", "suffix")


def _check_chat_only(body: dict):
    if body.get("modalities") not in (None, ["text"]):
        raise bad(f"only [\"text\"] is served, found {body['modalities']!r}", "modalities")
    if _flag(body, "store"):
        raise bad("nothing is stored", "store")
    if not _flag(body, "parallel_tool_calls", True):
        raise bad("false is not served (an answer may call several tools)", "parallel_tool_calls")
    if _flag(body, "continue_final_message"):
        raise bad("continuing the final message is not served", "continue_final_message")


def _chat_options(body: dict, codec) -> tuple[bool, int | None]:
    """(thinking, effort): chat_template_kwargs' thinking (or enable_thinking) and reasoning_effort
    (there or at the top level) on the format's scale; an effort asks for thinking."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("expected an object", "chat_template_kwargs")
    for key in kwargs:
        if key not in CHAT_KWARGS:
            raise bad(f"expected only {', '.join(CHAT_KWARGS)}, found {key!r}", "chat_template_kwargs")
    # the top-level enable_thinking (as SGLang and DeepSeek-style clients send it) means the same
    flags = {f"chat_template_kwargs.{k}": _flag(kwargs, k) for k in ("thinking", "enable_thinking")
             if kwargs.get(k) is not None}
    if body.get("enable_thinking") is not None:
        flags["enable_thinking"] = _flag(body, "enable_thinking")
    thinking = next(iter(flags.values())) if flags else None
    if len(set(flags.values())) > 1:
        raise bad(f"{' and '.join(flags)} disagree", next(reversed(flags)).split(".")[0])
    given = {n: v for n, v in (("reasoning_effort", body.get("reasoning_effort")),
                               ("chat_template_kwargs.reasoning_effort", kwargs.get("reasoning_effort")))
             if v is not None}
    if not given:
        return bool(thinking), None
    if thinking is False:
        raise bad(f"needs thinking mode, and {next(iter(flags))} is false", next(iter(given)))
    efforts = {name: _effort(value, name, codec) for name, value in given.items()}
    if len({DEFAULT_EFFORT if e is None else e for e in efforts.values()}) > 1:
        raise bad(f"{shown(given['reasoning_effort'])} disagrees with chat_template_kwargs.reasoning_effort "
                  f"{shown(given['chat_template_kwargs.reasoning_effort'])}; send one, or the same", "reasoning_effort")
    return True, next(iter(efforts.values()))


def _effort(value, name: str, codec):
    """A reasoning effort as the format states it (None: its default): V4.1 a number on its scale,
    V4 its name (``chat.stated_effort``, DeepSeek's reference encoders' efforts)."""
    if codec.chat_format not in VARIANTS:        # a Jinja template states no effort
        if value != "high":
            raise bad(f"the {codec.chat_format} chat format has one effort, \"high\", found {shown(value)}", name)
        return None
    try:
        return stated_effort(value, codec.chat_format)
    except ValueError as e:
        raise bad(str(e).split(": ", 1)[1], name) from None


def chat_prompt(body: dict, codec) -> tuple[list[int], bool, bool]:
    """(prompt ids, thinking, tools offered and to be parsed)."""
    if "messages" not in body:
        raise bad("missing", "messages")
    if codec is None:
        raise bad("chat needs the checkpoint's tokenizer (this server was started without --checkpoint); "
                  "use /v1/completions with token ids", "messages")
    thinking, effort = _chat_options(body, codec)
    generation_prompt = _flag(body, "add_generation_prompt", True)
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    try:
        ids = codec.encode_chat(body["messages"], thinking=thinking, tools=tools, effort=effort,
                                add_generation_prompt=generation_prompt)
        # vLLM's add_special_tokens (default false for chat): the tokenizer's BOS on top of the template's
        if _flag(body, "add_special_tokens") and codec.add_bos:
            ids = [codec.bos_id] + ids
        return ids, thinking and generation_prompt, bool(tools)
    except ValueError as e:               # the encoder's messages start with the field
        param = str(e).split(": ", 1)[0]
        raise ApiError(400, str(e), param if param.startswith(("messages", "tools", "reasoning_effort"))
                       else "messages") from None
    except Exception as e:                # a Jinja template that cannot render these messages
        raise bad(f"the chat template cannot render them: {e}", "messages") from None


def _truncated(body: dict, prompt: list[int], limits: Limits) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the server takes, the
    context less the row the answer's first token needs, as vLLM's max_model_len - 1)."""
    k = _int(body, "truncate_prompt_tokens", None, -1, limits.max_context)
    if k is None:
        return prompt
    if k == 0:
        raise bad(f"expected -1 or an integer in [1, {limits.max_context}], found 0", "truncate_prompt_tokens")
    return prompt[-(limits.max_prompt if k == -1 else k):]


def _echo(body: dict, generation_prompt: bool) -> str:
    """vLLM's chat echo: the answer starts with the last message's text when the answer continues
    that message's role (the assistant's, without a generation prompt opening a new turn)."""
    if not _flag(body, "echo") or generation_prompt:
        return ""
    last = body["messages"][-1] if body["messages"] else {}
    content = last.get("content") if isinstance(last, dict) else None
    if isinstance(content, list):        # text parts (the encoder has checked them)
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) and last.get("role") == "assistant" else ""


def _bad_words(body: dict, codec) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written (leading spaces dropped) and, when
    it tokenizes to as many tokens with a different first one, after a space too."""
    words = body.get("bad_words")
    if words is None or words == []:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise bad(f"expected a list of non-empty strings, found {shown(words)}", "bad_words")
    if codec is None:
        raise bad("words are text, and this server has no tokenizer (no --checkpoint)", "bad_words")
    out = []
    for word in words:
        plain = tuple(codec.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
        spaced = tuple(codec.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids)
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def _rows(body: dict, codec, thinking: bool, spec, vocab: int) -> Constraint | None:
    """What the request asks of its rows' masks besides its grammar (``engine.grammar.Constraint``,
    the grammar compiled into it later by ``constrained``): with thinking on, the token after which
    the structured output ``spec`` applies, the reasoning budget; allowed_token_ids and bad_words.
    None when it asks nothing."""
    budget = _int(body, "thinking_token_budget", None, 0)
    if budget is not None and not thinking:
        raise bad("needs thinking mode (chat_template_kwargs.thinking true, with a generation prompt)",
                  "thinking_token_budget")
    allowed = body.get("allowed_token_ids")
    allowed = None if allowed is None else tuple(_token_ids(allowed, "allowed_token_ids", vocab))
    words = _bad_words(body, codec)
    if spec is None and budget is None and allowed is None and not words:
        return None
    end = None
    if thinking and (spec is not None or budget is not None):
        end = codec.tokenizer.token_to_id(END_THINK)
        if end is None:
            raise bad(f"this tokenizer has no {END_THINK} token to end the reasoning at",
                      "thinking_token_budget" if spec is None else spec[0])
    return Constraint(vocab, None, end, budget, allowed, words, None if codec is None else codec.eos_id)


def _constraint(body: dict, chat: bool, codec) -> tuple[str, str, str] | None:
    """The request's structured output, (field, kind, text) within the bounds a constraint is held to
    (``serving.structured``), None without one; ``constrained`` compiles it. With thinking on it
    constrains what follows the reasoning (``_rows``)."""
    try:
        spec = structured.requested(body)
        choice = body.get("tool_choice") if chat else None
        if choice not in (None, "auto", "none"):
            if spec is not None:
                raise structured.Refused("tool_choice", f"one constraint a request, and {spec[0]} is given too")
            if codec is None:
                raise structured.Refused("tool_choice", "forcing a call needs the checkpoint's tokenizer")
            spec = ("tool_choice", "lark", structured.tool_grammar(body.get("tools"), choice, codec.chat_format,
                                                                   codec.tokenizer.token_to_id(DSML))[1])
        if spec is None:
            return None
        field, kind, text = spec
        if codec is None:
            raise structured.Refused(field, "structured output needs the checkpoint's tokenizer (this server was "
                                            "started without --checkpoint)")
        return structured.bounded(field, kind, text)
    except structured.Refused as e:
        raise bad(e.message, e.field) from None


def constrained(gen: Generation, compiler) -> Generation:
    """gen with its constraint compiled (``structured.Compiler``) into its sampling settings: the
    costly part of a check, run after every other (the server runs it on the compile threads)."""
    field, kind, text = gen.constraint
    try:      # the rows' constraint (``_rows``: made whenever there is a structured output) takes the grammar
        gen.params = replace(gen.params, grammar=replace(gen.params.grammar, grammar=compiler.grammar(kind, text,
                                                                                                      field)))
    except structured.Refused as e:
        raise bad(e.message, e.field) from None
    return gen


def generation(body: dict, chat: bool, codec, limits: Limits) -> Generation:
    """A request body checked against the served engine; raises ApiError naming the field. A
    structured output's constraint is checked and left to compile (``constrained``)."""
    check_fields(body, chat)
    thinking = tool_calls = False
    if chat:
        prompt, thinking, tool_calls = chat_prompt(body, codec)
    else:
        prompt = completion_prompt(body, codec, limits)
    prompt = _truncated(body, prompt, limits)
    spec = _constraint(body, chat, codec)
    rows = _rows(body, codec, thinking, spec, limits.vocab_size)
    where = "messages" if chat else "prompt"
    if len(prompt) > limits.max_prompt:
        raise bad(f"{len(prompt)} tokens is longer than the {limits.max_prompt} this server takes (max_model_len "
                  f"{limits.max_context}, a row left for the answer)", where)
    room = limits.max_context - len(prompt)
    n = _int(body, "n", 1, 1, MAX_N)
    if _int(body, "priority", 0, -2 ** 63, 2 ** 63 - 1) != 0:
        raise bad("only 0 is served: requests run first come, first served (vLLM's default policy, which "
                  "likewise refuses a priority)", "priority")
    if chat:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, name, room, 1)
    else:
        name = "max_tokens"
        max_tokens = _int(body, name, min(DEFAULT_COMPLETION_TOKENS, room), 1)
    if max_tokens > room:
        raise bad(f"{shown(max_tokens)} new tokens after a {len(prompt)}-token prompt exceed the context of "
                  f"{limits.max_context} tokens (at most {room})", name)
    top: int | None
    if chat:
        top = _int(body, "top_logprobs", 0, 0, 20) if _flag(body, "logprobs") else None
        if top is None and body.get("top_logprobs") is not None:
            raise bad("needs \"logprobs\": true", "top_logprobs")
    else:
        top = _int(body, "logprobs", None, 0, 20)
    stop = body.get("stop")
    if stop is not None and codec is None:
        raise bad("stop strings are text, and this server has no tokenizer (no --checkpoint); "
                  "use stop_token_ids", "stop")
    fields = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    fields.setdefault("temperature", DEFAULT_TEMPERATURE)
    if fields.get("top_k") == -1:      # vLLM's long-standing spelling of "off" (0 here)
        fields["top_k"] = 0
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = tuple(_token_ids(fields["stop_token_ids"], "stop_token_ids", limits.vocab_size))
    try:
        params = SamplingParams(**fields, stop=() if stop is None else stop, max_tokens=max_tokens,
                                logprobs=top or 0, logprob=top is not None,
                                logit_bias=_logit_bias(body, limits.vocab_size),
                                eos_token_id=None if codec is None else codec.eos_id, grammar=rows)
    except ValueError as e:
        field, _, message = str(e).partition(": ")
        raise bad(message, field.split("[")[0]) from None
    stream = _flag(body, "stream")
    include_usage, continuous = _usage_options(body, stream)
    request_id = body.get("request_id")
    if request_id is not None and not (isinstance(request_id, str) and request_id):
        raise bad(f"expected a non-empty string, found {shown(request_id)}", "request_id")
    return Generation(prompt, params, stream, include_usage, chat, top, thinking, tool_calls, n,
                      _flag(body, "skip_special_tokens", True), _flag(body, "spaces_between_special_tokens", True),
                      _cache_salt(body, limits.require_cache_salt), spec, continuous, request_id,
                      _echo(body, _flag(body, "add_generation_prompt", True)) if chat else "",
                      _flag(body, "return_token_ids"), _flag(body, "return_tokens_as_token_ids"))


def _cache_salt(body: dict, required: bool) -> str | None:
    """vLLM's cache_salt: a non-empty string (as vLLM checks it), mixed into the prompt's first span
    hash (``prefix_cache.root``); a server that isolates tenants requires one."""
    salt = body.get("cache_salt")
    if salt is None:
        if required:
            raise bad("required by this server (--require-cache-salt): send your tenant's own salt, so that "
                      "no other tenant's prompt shares your cached prefix", "cache_salt")
        return None
    if not isinstance(salt, str) or not salt:
        raise bad(f"expected a non-empty string, found {shown(salt)}", "cache_salt")
    return salt


def _usage_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """stream_options (as OpenAI: only with "stream": true): (a last chunk with the usage, vLLM's
    continuous_usage_stats: every chunk with the usage so far, which needs include_usage)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise bad(f"expected an object, found {shown(options)}", "stream_options")
    if not stream:
        raise bad("only allowed with \"stream\": true", "stream_options")
    for key in options:
        if key not in STREAM_OPTIONS:
            raise bad(f"expected only {', '.join(STREAM_OPTIONS)}, found {shown(key)}", "stream_options")
    include = _flag(options, "include_usage", True)     # vLLM's default once stream_options is sent
    return include, include and _flag(options, "continuous_usage_stats")


def _logit_bias(body: dict, vocab: int) -> tuple:
    """OpenAI's logit_bias, {"token id": bias}, as (id, bias) pairs (the bias range is
    SamplingParams')."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad(f"expected an object of token id to bias, found {bias!r}", "logit_bias")
    pairs = []
    for key, value in bias.items():
        # ASCII digits only: str.isdigit and int() also take other scripts' digits ("٣" is 3)
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(vocab))
        token = int(key) if digits else None
        if token is None or token >= vocab:
            raise bad(f"keys must be token ids in [0, {vocab - 1}] written in ASCII digits, found {shown(key)}",
                      "logit_bias")
        pairs.append((token, value))
    return tuple(pairs)


# ---- responses -------------------------------------------------------------------------------------------

def envelope(kind: str, rid: str, model: str) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; cached: prompt tokens served from the prefix cache (None: caching off)."""
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def token_text(codec, token: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or (vLLM's return_tokens_as_token_ids, or no
    tokenizer) its id."""
    if as_id:
        return f"token_id:{token}"
    return str(token) if codec is None else codec.tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(entries: list, codec, as_ids: bool = False) -> dict:
    """OpenAI's completions logprobs: per token its text, logprob and top alternatives."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, (lp, top) in entries:
        text = token_text(codec, token, as_ids)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({token_text(codec, i, as_ids): v for i, v in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: list, codec, as_ids: bool = False) -> dict:
    def one(token, lp):
        text = token_text(codec, token, as_ids)
        # the token's own bytes, not U+FFFD's (vLLM: a token named by its id has that name's bytes)
        raw = text.encode() if codec is None or as_ids else codec.token_bytes(token)
        return {"token": text, "logprob": lp, "bytes": list(raw)}
    return {"content": [{**one(token, lp), "top_logprobs": [one(i, v) for i, v in top]}
                        for token, (lp, top) in entries]}
