"""Test checkpoints in the released layout (written by ``python -m dsv41.checkpoint.write DIR``).

Random weights of a preset (``weights.draw_checkpoint``, written as drawn) in sharded safetensors with
``model.safetensors.index.json``, ``config.json``, a byte-level BPE ``tokenizer.json`` trained on a
few paragraphs (aiming at the config's vocab_size; a small corpus can fall short for larger
vocabularies, leaving spare embedding rows as the released model has) whose added tokens are the
V4.1 chat format's control tokens, and a ``tokenizer_config.json`` with BOS/EOS and, as the V4
releases, no Jinja chat template: chats are rendered by the encoder (``checkpoint/chat.py``),
which the server picks as V4.1 from these tokens. The config's Engram compressed
vocabulary is set to what the tokenizer's token map gives, as the released checkpoint's is.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import stat
from dataclasses import replace
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv41.checkpoint import checksums, config_json
from dsv41.checkpoint.chat import BOS, CONTROLS, EOS
from dsv41.checkpoint.headers import INDEX
from dsv41.checkpoint.text import TOKENIZER, TOKENIZER_CONFIG
from dsv41.checkpoint.token_map import build_token_map
from dsv41.config import ModelConfig
from dsv41.capacity import Capacity
from dsv41.outputs import open_path, same_file, write_output
from dsv41.weights import draw_checkpoint

PAD = "<｜▁pad▁｜>"
# BOS and EOS first (ids 0 and 1, as in the released tokenizer), then the rest of V4.1's controls
SPECIAL_TOKENS = [BOS, EOS, PAD] + [t for t in CONTROLS["v4.1"] if t not in (BOS, EOS)]

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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.split("\n\n"), trainer)
    return tok


def save_tensors(tensors, folder: int, shard_bytes: int):
    """Sharded safetensors from (name, tensor) pairs into the open ``folder``, written as each shard fills
    (a new shard when the next tensor would pass shard_bytes, so only one shard is held), then the
    index with each tensor's SHA-256 as stored (``checksums``)."""
    from safetensors.torch import save

    shards, cur, size, total, digests = [], {}, 0, 0, {}

    def flush():
        fname = f"model-{len(shards) + 1:05d}.safetensors"
        data = save(cur)
        digests.update(checksums.shard_digests(data))
        write_output(fname, data, dir_fd=folder)
        shards.append((fname, list(cur)))

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > shard_bytes:
            flush()
            cur, size = {}, 0
        cur[name] = t.contiguous()
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, (fname, names) in enumerate(shards):     # the released names: model-0000i-of-0000n
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(fname, final, src_dir_fd=folder, dst_dir_fd=folder)
        weight_map.update(dict.fromkeys(names, final))
    write_output(INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map,
                                    checksums.KEY: {n: digests[n] for n in weight_map}}, indent=1), dir_fd=folder)


def check_target(path: Path, folder: int | None = None) -> None:
    """OSError unless ``path`` is free for a new checkpoint: absent, or an empty writable real folder
    (an existing checkpoint is never written over: its files could be links planted to anywhere).
    folder: a handle on ``path``'s parent, where its name is looked up (the one the writer holds)."""
    name = path.name if folder is not None else path
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "is a symbolic link; give a real folder (the writer never writes through a link)",
                      str(path))
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "exists and is not a folder", str(path))
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    try:
        full = any(os.scandir(fd))
    finally:
        os.close(fd)
    if full:
        raise OSError(errno.ENOTEMPTY, "is not empty; give a new or empty folder (nothing is written over)", str(path))
    if not os.access(name, os.W_OK | os.X_OK, dir_fd=folder):
        raise OSError(errno.EACCES, "is not writable", str(path))


def write_checkpoint(cfg: ModelConfig, path: str | os.PathLike, seed: int = 0, shard_bytes: int = 1 << 28,
                     capacity: Capacity | None = None) -> ModelConfig:
    """Write a test checkpoint folder; returns the config it holds (the preset with the token map's
    compressed vocabulary). capacity: the limits its config.json keeps (default: the preset's).

    The files go into a new hidden folder beside ``path``, renamed to ``path`` when complete: a failure
    (a full disk, Ctrl-C, SIGTERM) removes it and leaves nothing that looks like a checkpoint. ``path``
    must be absent or an empty folder (``check_target``); missing parents are made. No path is followed
    twice: the parent is opened once, component by component without following a link
    (``outputs.open_path``), and held for the whole run, as is the hidden folder; every file is created
    and renamed relative to those handles, so a folder swapped for another or for a link mid-run
    receives nothing. Before and after the final rename the handles must still be what the paths name
    (``_in_place``); a swap is refused (OSError, nothing put in place, the work removed)."""
    if not os.fspath(path):     # Path("") is the current folder
        raise OSError(errno.ENOENT, "is empty; give the folder to write", "path")
    target = Path(os.path.abspath(path))
    try:
        parent = open_path(target.parent, make=True)
        try:
            check_target(target, parent)
            tok = train_tokenizer(cfg.vocab_size)
            _, compressed = build_token_map(tok, cfg.vocab_size, cfg.engram_pad_token_id)
            cfg = replace(cfg, engram_compressed_vocab_size=compressed).validate()
            _write_in_place(cfg, tok, target, parent, seed, shard_bytes, capacity)
        finally:
            os.close(parent)
    except OSError as e:
        if e.filename == str(target):       # named as the caller named it
            raise OSError(e.errno, e.strerror, os.fspath(path)) from e
        raise
    return cfg


def _write_in_place(cfg, tok, path: Path, parent: int, seed: int, shard_bytes: int, capacity) -> None:
    work = f".{path.name}.partial-{secrets.token_hex(6)}"
    try:
        os.mkdir(work, 0o755, dir_fd=parent)    # exclusive: an existing name (or a link planted there) fails
        folder = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        save_tensors(draw_checkpoint(cfg, seed), folder, shard_bytes)
        write_output(config_json.FILE, json.dumps(config_json.to_json(cfg, capacity), indent=1), dir_fd=folder)
        write_output(TOKENIZER, tok.to_str(pretty=True), dir_fd=folder)
        write_output(TOKENIZER_CONFIG, json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True, "add_eos_token": False},
            indent=1), dir_fd=folder)
        _in_place(path, parent, work, folder)
        check_target(path, parent)  # still free (the rename would replace an empty folder, or fail on a full one)
        os.rename(work, path.name, src_dir_fd=parent, dst_dir_fd=parent)
        try:
            _in_place(path, parent, path.name, folder)
        except OSError:     # swapped between the check and the rename: take ours back out of the way
            if _holds(parent, path.name, folder):
                os.rename(path.name, work, src_dir_fd=parent, dst_dir_fd=parent)
            raise
    except BaseException as e:
        _discard(parent, work, folder)
        if isinstance(e, OSError) and e.filename != str(path):     # the hidden folder's names mean nothing
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    finally:
        os.close(folder)


def _in_place(path: Path, parent: int, name: str, folder: int) -> None:
    """OSError(ESTALE) unless ``path``'s parent, walked again from ``/``, is still the folder held open and
    ``name`` in it is still the work folder held open: a folder swapped mid-run (for another, or for a
    link) would put the checkpoint somewhere else than ``path``, or a link at it."""
    try:
        now = open_path(path.parent)
    except OSError as e:
        raise OSError(errno.ESTALE, f"{path.parent} was replaced while the checkpoint was written ({e.filename}: "
                      f"{e.strerror}); nothing was put in place", str(path)) from None
    try:
        moved = not same_file(os.fstat(now), os.fstat(parent))
    finally:
        os.close(now)
    if moved:
        raise OSError(errno.ESTALE, f"{path.parent} was replaced by another folder while the checkpoint was "
                      "written; nothing was put in place", str(path))
    if not _holds(parent, name, folder):
        raise OSError(errno.ESTALE, f"the work folder {path.parent / name} was replaced (by a link or another "
                      "folder) while the checkpoint was written; nothing was put in place", str(path))


def _discard(parent: int, work: str, folder: int) -> None:
    """Remove what the run wrote, through the handles: the files in the work folder (wherever it is now),
    then the folder itself when ``work`` in the held parent is still it. SIGINT and SIGTERM wait until
    it is done, so a second signal cannot leave half of it behind."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        for name in os.listdir(folder):
            try:
                os.unlink(name, dir_fd=folder)
            except OSError:
                pass        # not a file of ours (a folder planted in it): left as it is
        try:
            if _holds(parent, work, folder):
                os.rmdir(work, dir_fd=parent)
        except OSError:
            pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _holds(parent: int, name: str, folder: int) -> bool:
    """Whether ``name`` in the folder ``parent`` is the folder ``folder`` (not a link, not another)."""
    try:
        return same_file(os.stat(name, dir_fd=parent, follow_symlinks=False), os.fstat(folder))
    except FileNotFoundError:
        return False
