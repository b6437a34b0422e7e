"""vLLM's ``/tokenize`` and ``/detokenize`` bodies: a prompt (or a chat, rendered as the chat
endpoint renders it) to its ids, and ids to their text, checked as the generation endpoints check
theirs (a 400 naming the field)."""
from __future__ import annotations

from dsv41.serving import schema
from dsv41.serving.schema import Limits, _flag, _token_ids, bad

PROMPT_FIELDS = frozenset(("model", "prompt", "add_special_tokens", "return_token_strs"))
CHAT_FIELDS = frozenset(("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                         "chat_template_kwargs", "reasoning_effort", "enable_thinking", "tools", "tool_choice",
                         "return_token_strs"))
DETOKENIZE_FIELDS = frozenset(("model", "tokens"))


def _only(body: dict, fields: frozenset, where: str):
    for name in body:
        if name not in fields:
            raise bad(f"not a field {where} takes", name)


def tokenize(body: dict, codec, limits: Limits) -> dict:
    """vLLM's TokenizeResponse: the ids of ``prompt`` (BOS first unless add_special_tokens is false)
    or of ``messages`` rendered with a generation prompt (the chat endpoint's prompt, token for
    token); with return_token_strs, each id's token string."""
    chat = "messages" in body
    _only(body, CHAT_FIELDS if chat else PROMPT_FIELDS, "/tokenize")
    if codec is None:
        raise bad("tokenizing needs the checkpoint's tokenizer (this server was started without --checkpoint)",
                  "messages" if chat else "prompt")
    if chat:
        schema.check_fields({k: v for k, v in body.items() if k != "return_token_strs"}, True)
        ids = schema.chat_prompt(body, codec)[0]
    else:
        if not isinstance(body.get("prompt"), str):
            raise bad(f"expected a string, found {schema.shown(body.get('prompt'))}", "prompt")
        ids = schema.completion_prompt(body, codec, limits)
    strs = [codec.tokenizer.id_to_token(t) for t in ids] if _flag(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": limits.max_context, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, codec, limits: Limits) -> dict:
    """vLLM's DetokenizeResponse: the text of ``tokens``, special tokens' text included (vLLM
    decodes them as its tokenizer's decode does by default)."""
    _only(body, DETOKENIZE_FIELDS, "/detokenize")
    if codec is None:
        raise bad("detokenizing needs the checkpoint's tokenizer (this server was started without --checkpoint)",
                  "tokens")
    if "tokens" not in body:
        raise bad("missing", "tokens")
    if body["tokens"] == []:
        return {"prompt": ""}
    ids = _token_ids(body["tokens"], "tokens", limits.vocab_size)
    return {"prompt": codec.tokenizer.decode(ids, skip_special_tokens=False)}
