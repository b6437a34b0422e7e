"""Test checkpoints in the released layout (written by ``python -m dsv41.checkpoint.write DIR``).

Random weights of a preset (``weights.init_checkpoint``) in sharded safetensors with
``model.safetensors.index.json``, ``config.json``, a byte-level BPE ``tokenizer.json`` trained on a
few paragraphs (aiming at the config's vocab_size; a small corpus can fall short for larger
vocabularies, leaving spare embedding rows as the released model has), and a
``tokenizer_config.json`` with BOS/EOS and a chat template. The config's Engram compressed
vocabulary is set to what the tokenizer's token map gives, as the released checkpoint's is.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv41.checkpoint import config_json
from dsv41.checkpoint.headers import INDEX
from dsv41.checkpoint.text import TOKENIZER, TOKENIZER_CONFIG
from dsv41.checkpoint.token_map import build_token_map
from dsv41.config import ModelConfig
from dsv41.weights import init_checkpoint

BOS, EOS, PAD, USER, ASSISTANT = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                                  "<｜Assistant｜>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}" + USER +
                 "{{ m['content'] }}{% else %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")

CORPUS = """\
The river runs past the old mill every morning, and the miller counts the sacks of grain before the
sun is high. In winter the water freezes at the edges, so the wheel turns slowly and the village
waits for flour. Children walk along the bank to school, throwing stones and naming the birds.

A small model learns from the text it is given. When the paragraphs are short, the tokenizer keeps
frequent words whole and splits rare ones into pieces. Numbers such as 2024, 3.14 and 1000000 are
cut into digits; punctuation (commas, full stops; colons: dashes - and quotes "like these") stays
apart.

Café, naïve, résumé and Ærø keep their accents in the text, but the Engram token map folds them:
CAFÉ and café hash alike, as do "The", "the" and " THE". Tabs\tand\nnew lines collapse into one
space. Über straße façade coöperate.

Weather reports speak of rain in the north, wind along the coast and clear skies in the south.
Farmers watch the clouds, sailors watch the waves, and the baker watches the oven, because bread
burns quickly when nobody is looking.

Every card in the cluster holds its own slice of the weights: the experts of its rank, its share
of the heads, and a part of the vocabulary. Requests arrive, tokens are generated one at a time,
and the text streams back while the model is still decoding the next word.
"""


def train_tokenizer(vocab_size: int, corpus: str = CORPUS) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.split("\n\n"), trainer)
    return tok


def save_tensors(ck: dict[str, torch.Tensor], path: Path, shard_bytes: int):
    """Sharded safetensors (a new shard when the next tensor would pass shard_bytes) and the index."""
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for name, t in ck.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t.contiguous()
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname))
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in ck.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def write_checkpoint(cfg: ModelConfig, path: str | os.PathLike, seed: int = 0, shard_bytes: int = 1 << 28) -> ModelConfig:
    """Write a test checkpoint folder; returns the config it holds (the preset with the token map's
    compressed vocabulary)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(cfg.vocab_size)
    _, compressed = build_token_map(tok, cfg.vocab_size, cfg.engram_pad_token_id)
    cfg = replace(cfg, engram_compressed_vocab_size=compressed).validate()
    save_tensors(init_checkpoint(cfg, seed), path, shard_bytes)
    (path / config_json.FILE).write_text(json.dumps(config_json.to_json(cfg), indent=1))
    tok.save(str(path / TOKENIZER))
    (path / TOKENIZER_CONFIG).write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True, "add_eos_token": False,
         "chat_template": CHAT_TEMPLATE}, indent=1))
    return cfg
