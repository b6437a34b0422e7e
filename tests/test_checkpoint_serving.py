"""A TINY checkpoint folder served as text: every executor equals ReferenceEngine on the same folder."""
import json

import pytest
import torch

from dsv41.checkpoint.reader import open_checkpoint
from dsv41.checkpoint.shards import RowLookup
from dsv41.checkpoint.text import TextCodec
from dsv41.config import TINY
from dsv41.engine.reference import ReferenceEngine
from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops
from dsv41.run import main
from dsv41.weights import checkpoint_specs, decode_checkpoint, init_checkpoint

PROMPTS = ["The river runs past the old mill", "Café"]
NEW = 2


@pytest.fixture(scope="module")
def opened(tiny_checkpoint):
    return open_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def drawn(opened):
    return init_checkpoint(opened.cfg, seed=0)


@pytest.fixture(scope="module")
def reference(opened, tiny_checkpoint):
    """ReferenceEngine on the folder, and its greedy tokens and text cut after EOS."""
    codec = TextCodec.load(tiny_checkpoint)
    prompts = [codec.encode(p) for p in PROMPTS]
    model = ReferenceEngine(opened.cfg, checkpoint=opened, max_batch=len(prompts),
                           max_context=max(map(len, prompts)) + NEW + 1)
    tokens = model.generate(prompts, NEW)
    tokens = [t[: t.index(codec.eos_id) + 1] if codec.eos_id in t else t for t in tokens]
    return tokens, [codec.decode(t) for t in tokens], model


def _serve(capsys, folder, *extra):
    args = ["--checkpoint", str(folder), "--new-tokens", str(NEW), "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    assert main(args + list(extra)) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_folder_holds_the_seed_weights_and_a_tokenizer_of_the_vocab(opened, drawn, tiny_checkpoint):
    cfg = opened.cfg
    assert cfg.name == "tiny" and cfg.vocab_size == TINY.vocab_size
    assert opened.names() == list(checkpoint_specs(cfg))
    for name in opened.names():
        got = opened.get(name)
        assert got.dtype == drawn[name].dtype and torch.equal(got.view(torch.uint8), drawn[name].view(torch.uint8))
    codec = TextCodec.load(tiny_checkpoint)
    assert codec.size == cfg.vocab_size and codec.bos_id is not None and codec.eos_id is not None
    assert codec.decode(codec.encode("Café, naïve; 3.14")) == "Café, naïve; 3.14"
    # a slice read is that slice of the tensor
    name = "layers.3.ffn.experts.5.w2.weight"
    assert torch.equal(opened.get(name, (slice(8, 40), slice(2, 7))), drawn[name][8:40, 2:7])


def test_reference_on_the_folder_uses_its_weights_and_token_map(opened, drawn, reference):
    model = reference[2]
    want = decode_checkpoint(opened.cfg, drawn)
    def whole(w):   # a lookup table decodes the rows looked up: look them all up
        return w[torch.arange(w.shape[0])] if isinstance(w, RowLookup) else w
    assert all(torch.equal(whole(model.weights[k]), want[k]) for k in want)
    assert model.host.tables[0].token_map is opened.token_map


@pytest.mark.parametrize("layout", [("sync", "2", "1"), ("threads", "1", "2")])
def test_text_on_local_executors_equals_the_reference(capsys, tiny_checkpoint, reference, layout):
    executor, tp, dp = layout
    out, err = _serve(capsys, tiny_checkpoint, "--executor", executor, "--tp", tp, "--dp", dp)
    tokens, text, _ = reference
    assert out["config"] == "tiny" and out["tokens"] == tokens and out["text"] == text
    # streamed while decoding: every request's pieces, in order, make its text
    pieces = {i: "" for i in range(len(PROMPTS))}
    for line in err.splitlines():
        if line.startswith("    ["):
            i, rest = line.strip()[1:].split("] ", 1)
            pieces[int(i)] += eval(rest.removesuffix(" <eos>"))   # the stream prints repr()s
    assert [pieces[i] for i in range(len(PROMPTS))] == text


@pytest.mark.timeout(240)
def test_text_on_distributed_equals_the_reference(capsys, tiny_checkpoint, reference):
    out, _ = _serve(capsys, tiny_checkpoint, "--executor", "distributed", "--tp", "2", "--dp", "1")
    assert out["tokens"] == reference[0] and out["text"] == reference[1]


def test_chat_without_a_template_is_the_v41_encoding(tiny_checkpoint):
    """The writer ships no Jinja template and V4.1's control tokens: --chat is the V4.1 encoding."""
    from dsv41.checkpoint.chat import encode_messages
    codec = TextCodec.load(tiny_checkpoint)
    assert codec.chat_template is None and codec.chat_format == "v4.1"
    ids = codec.encode("hello", chat=True)
    assert ids[0] == codec.bos_id
    assert codec.tokenizer.decode(ids, skip_special_tokens=False) == \
        encode_messages([{"role": "user", "content": "hello"}], variant="v4.1") == \
        "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>"


def test_a_chat_template_wraps_the_prompt(tiny_checkpoint):
    codec = TextCodec.load(tiny_checkpoint)
    codec.chat_template = ("{{ bos_token }}{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}"
                           "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
    assert codec.chat_format == "template"
    ids = codec.encode("hello", chat=True)
    assert codec.tokenizer.decode(ids, skip_special_tokens=False) == \
        "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜>"


def test_stream_stops_a_request_at_eos_and_holds_back_partial_utf8(tiny_checkpoint):
    codec = TextCodec.load(tiny_checkpoint)
    stops = [Stops(SamplingParams(), 1 << 20, codec.eos_id, codec.decode) for _ in range(2)]
    e_acute = codec.tokenizer.encode("é", add_special_tokens=False).ids
    first = stops[0].push(codec.tokenizer.token_to_id("Ã"))
    stops[1].push(codec.eos_id)
    assert [s.finish for s in stops] == [None, "stop"]
    assert len(e_acute) == 1 and first == ""                # 0xC3 alone: nothing shown yet
    assert stops[0].push(codec.tokenizer.token_to_id("©")) == "é"   # 0xC3 0xA9 completes é


def test_plan_sizes_the_checkpoints_config(capsys, tiny_checkpoint, opened, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--plan", "--checkpoint", str(tiny_checkpoint), "--tp", "1", "--dp", "1", "--context", "64",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["config"] == "tiny"
    held = sum(opened.get(n).numel() * opened.get(n).element_size() for n in opened.names())
    assert plan["plan"]["cards"][0]["weights_bytes"] == held


def test_stop_string_cuts_the_text(capsys, tiny_checkpoint):
    base = ["--checkpoint", str(tiny_checkpoint), "--prompt", PROMPTS[0], "--new-tokens", "8", "--json",
            "--executor", "reference"]
    assert main(base) == 0
    text = json.loads(capsys.readouterr().out)["text"][0]
    stop = text[3:5]
    assert len(stop) == 2 and stop.strip()
    assert main(base + ["--stop", stop]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == [text[:text.find(stop)]]
