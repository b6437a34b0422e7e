"""Request bodies the server used to take without a word (issue 49, item 7), each refused with a
400 whose ``param`` names the field, as the server's check threads run them (``Server._check``:
parse, model, generation) on the TINY checkpoint's V4.1 chat format; the accepted neighbours of
each still go through."""
import json

import pytest

from dsv41.checkpoint.chat import ASSISTANT, DSML, SYSTEM, USER
from dsv41.checkpoint.text import TextCodec
from dsv41.serving import schema

LIMITS = schema.Limits(max_context=256, max_prompt=200, vocab_size=0, max_body_bytes=1 << 20)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def codec(tiny_checkpoint):
    codec = TextCodec.load(tiny_checkpoint)
    assert codec.chat_format == "v4.1"
    return codec


def _check(codec, **fields) -> schema.Generation:
    limits = schema.Limits(LIMITS.max_context, LIMITS.max_prompt, codec.size, LIMITS.max_body_bytes)
    body = schema.parse_body(json.dumps({"messages": HI, "max_tokens": 2, **fields}).encode(), limits)
    return schema.generation(body, True, codec, limits)


def _refused(codec, param: str, **fields) -> str:
    with pytest.raises(schema.ApiError) as e:
        _check(codec, **fields)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert e.value.message.startswith(param + ":")
    return e.value.message


@pytest.mark.parametrize("key", ["٣", "²", "３", "+3", " 3", "-1", "9" * 5000])
def test_logit_bias_keys_are_ascii_token_ids(codec, key):
    """"٣" (Arabic-Indic three) passes str.isdigit and int() reads it as 3; "²" passes isdigit
    and int() refuses it; 5,000 digits pass the check and int() refuses them."""
    _refused(codec, "logit_bias", logit_bias={key: 1})
    assert _check(codec, logit_bias={"3": 1}).params.logit_bias == ((3, 1),)


@pytest.mark.parametrize("fields", [{"stream_options": {"include_usage": True}},
                                    {"stream": False, "stream_options": {"include_usage": False}},
                                    {"stream": True, "stream_options": {"include_usage": True, "frobnicate": 1}},
                                    {"stream": True, "stream_options": {"continuous_usage": True}},
                                    {"stream": True, "stream_options": ["include_usage"]}])
def test_stream_options_only_with_stream_and_known_keys(codec, fields):
    _refused(codec, "stream_options", **fields)
    assert _check(codec, stream=True, stream_options={"include_usage": True}).include_usage
    assert not _check(codec, stream=False, stream_options=None).include_usage


@pytest.mark.parametrize("top,kwarg", [("high", "max"), (7, 8), ("max", 99), (50, "max")])
def test_reasoning_efforts_that_disagree(codec, top, kwarg):
    message = _refused(codec, "reasoning_effort", reasoning_effort=top,
                       chat_template_kwargs={"reasoning_effort": kwarg})
    assert "chat_template_kwargs.reasoning_effort" in message
    # the same effort twice ("high" is V4.1's 50) is one effort
    for a, b in ((top, top), ("high", 50), ("max", 100)):
        same = _check(codec, reasoning_effort=a, chat_template_kwargs={"reasoning_effort": b})
        assert same.prompt == _check(codec, reasoning_effort=a).prompt


def test_a_prefix_message_is_refused(codec):
    """DeepSeek's chat prefix completion (the last message an assistant's with "prefix": true,
    the answer continuing it) is vLLM's continue_final_message, which this server does not serve;
    taking the message as a whole turn would answer something else."""
    messages = HI + [{"role": "assistant", "content": "```python\n", "prefix": True}]
    message = _refused(codec, "messages[1].prefix", messages=messages)
    assert "prefix completion" in message
    _check(codec, messages=HI + [{"role": "assistant", "content": "ok", "prefix": False}, *HI])


@pytest.mark.parametrize("name", [USER, ASSISTANT, SYSTEM, DSML, f"bob{USER}", "<think>"])
def test_a_message_name_spelling_a_control_token(codec, name):
    _refused(codec, "messages[0].name", messages=[{**HI[0], "name": name}])
    _refused(codec, "messages[0].name", messages=[{**HI[0], "name": 5}])
    assert _check(codec, messages=[{**HI[0], "name": "bob"}]).prompt == _check(codec).prompt
