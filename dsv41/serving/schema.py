"""OpenAI request bodies checked before anything reaches the engine, and the response bodies.

Every refusal is an ``ApiError``: an HTTP status and OpenAI's error object, whose ``param`` names
the field. The ranges are ``SamplingParams``' own (its messages start with the field's name).
Without a tokenizer (no ``--checkpoint``) prompts are token ids (``"prompt": [ints]``) and the
answers carry ``token_ids`` (their ``text`` is empty); chat, text prompts and stop strings need
the checkpoint's tokenizer.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from dsv41.ops.sampling import SamplingParams

# body fields that go straight to SamplingParams (same names)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop_token_ids")
DEFAULT_TEMPERATURE = 1.0          # OpenAI's default; send 0 for greedy
DEFAULT_COMPLETION_TOKENS = 16     # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
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


@dataclass
class Generation:
    """A checked request: prompt ids, sampling settings, and how to answer."""
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    top_logprobs: int | None       # None: no logprobs asked


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
    if not isinstance(body, dict):
        raise bad(f"expected a JSON object, found {type(body).__name__}", "body")
    return body


def check_model(body: dict, served: str):
    if "model" not in body:
        raise bad("missing (this server serves " + repr(served) + ")", "model")
    if body["model"] != served:
        raise ApiError(404, f"model: {body['model']!r} is not served here; the model is {served!r}", "model",
                       code="model_not_found")


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"expected true or false, found {value!r}", name)
    return value


def _int(body: dict, name: str, default, low: int, high: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"expected an integer, found {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise bad(f"expected an integer in {bound}, found {value}", name)
    return value


def _token_ids(value, name: str, vocab: int) -> list[int]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad("expected a non-empty list of token ids", name)
    out_of_range = [t for t in value if not 0 <= t < vocab]
    if out_of_range:
        raise bad(f"token ids must be in [0, {vocab - 1}], found {out_of_range[0]}", name)
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
        return codec.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"one prompt per request, found {len(prompt)}", "prompt")
    if not isinstance(prompt, list):
        raise bad(f"expected a string or a list of token ids, found {type(prompt).__name__}", "prompt")
    return _token_ids(prompt, "prompt", limits.vocab_size)


def chat_prompt(body: dict, codec) -> list[int]:
    if "messages" not in body:
        raise bad("missing", "messages")
    if codec is None:
        raise bad("chat needs the checkpoint's tokenizer (this server was started without --checkpoint); "
                  "use /v1/completions with token ids", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("expected an object", "chat_template_kwargs")
    thinking = _flag(kwargs, "thinking")
    try:
        return codec.encode_chat(body["messages"], thinking=thinking, tools=body.get("tools"))
    except ValueError as e:               # the encoder's messages start with the field
        param = str(e).split(": ", 1)[0]
        raise ApiError(400, str(e), param if param.startswith(("messages", "tools")) else "messages") from None
    except Exception as e:                # a Jinja template that cannot render these messages
        raise bad(f"the chat template cannot render them: {e}", "messages") from None


def generation(body: dict, chat: bool, codec, limits: Limits) -> Generation:
    """A request body checked against the served engine; raises ApiError naming the field."""
    prompt = chat_prompt(body, codec) if chat else completion_prompt(body, codec, limits)
    where = "messages" if chat else "prompt"
    if len(prompt) > limits.max_prompt:
        raise bad(f"{len(prompt)} tokens is longer than the {limits.max_prompt} this server takes", where)
    room = limits.max_context - len(prompt)
    if _int(body, "n", 1, 1) != 1:
        raise bad("only n = 1 is served", "n")
    if chat:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, name, room, 1)
    else:
        name = "max_tokens"
        max_tokens = _int(body, name, min(DEFAULT_COMPLETION_TOKENS, room), 1)
        if _flag(body, "echo"):
            raise bad("echo is not served", "echo")
    if max_tokens > room:
        raise bad(f"{max_tokens} new tokens after a {len(prompt)}-token prompt exceed the context of "
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
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = tuple(_token_ids(fields["stop_token_ids"], "stop_token_ids", limits.vocab_size))
    try:
        params = SamplingParams(**fields, stop=() if stop is None else stop, max_tokens=max_tokens,
                                logprobs=top or 0, logprob=top is not None)
    except ValueError as e:
        field, _, message = str(e).partition(": ")
        raise bad(message, field.split("[")[0]) from None
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("expected an object", "stream_options")
    return Generation(prompt, params, stream, _flag(options, "include_usage"), chat, top)


# ---- responses -------------------------------------------------------------------------------------------

def envelope(kind: str, rid: str, model: str) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(codec, token: int) -> str:
    return str(token) if codec is None else codec.tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(entries: list, codec) -> dict:
    """OpenAI's completions logprobs: per token its text, logprob and top alternatives."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, (lp, top) in entries:
        text = token_text(codec, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({token_text(codec, i): v for i, v in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: list, codec) -> dict:
    def one(token, lp):
        text = token_text(codec, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [{**one(token, lp), "top_logprobs": [one(i, v) for i, v in top]}
                        for token, (lp, top) in entries]}
