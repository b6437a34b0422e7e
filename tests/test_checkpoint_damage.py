"""Damaged checkpoint folders are refused before any step, naming the file and the tensor."""
import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.checkpoint import config_json
from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.headers import INDEX, read_header
from dsv41.checkpoint.reader import open_checkpoint
from dsv41.config import FLASH, SMALL, TINY
from dsv41.run import main
from checkpoint_edits import reseal


def _index(folder):
    return json.loads((folder / INDEX).read_text())


def _shard_of(folder, name):
    return _index(folder)["weight_map"][name]


def _rewrite(folder, name, value):
    """Replace (value a tensor), add, or drop (value None) one tensor, keeping the index in step."""
    index = _index(folder)
    file = index["weight_map"].get(name) or next(iter(index["weight_map"].values()))
    tensors = load_file(str(folder / file))
    if value is None:
        del tensors[name]
        del index["weight_map"][name]
    else:
        tensors[name] = value
        index["weight_map"][name] = file
    save_file(tensors, str(folder / file))
    (folder / INDEX).write_text(json.dumps(index))
    return file


def _patch_bytes(folder, name, fn):
    """Overwrite a tensor's stored bytes in place with fn(old bytes)."""
    file = _shard_of(folder, name)
    path = folder / file
    header, _ = read_header(path)
    start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    begin, end = header[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + begin:start + end] = fn(bytes(data[start + begin:start + end]))
    path.write_bytes(bytes(data))
    return file


def _tensor(folder, name):
    return load_file(str(folder / _shard_of(folder, name)))[name]


def missing(folder):   # gone from its shard and the index: the index is where it should be listed
    _rewrite(folder, "layers.5.attn.wkv.scale", None)
    return INDEX, "layers.5.attn.wkv.scale", "missing"


def extra(folder):
    name = "layers.5.attn.wq_c.weight"
    return _rewrite(folder, name, torch.zeros(4, 4, dtype=torch.bfloat16)), name, "unexpected"


def wrong_shape(folder):   # a head with 504 rows would silently shrink the vocabulary
    return _rewrite(folder, "head.weight", _tensor(folder, "head.weight")[:504]), "head.weight", "shape"


def uint8_for_fp8(folder):
    name = "layers.3.attn.wq_a.weight"
    return _rewrite(folder, name, _tensor(folder, name).view(torch.uint8)), name, "dtype F8_E4M3"


def bf16_for_fp4(folder):
    name = "layers.4.ffn.experts.2.w1.weight"
    return _rewrite(folder, name, _tensor(folder, name).to(torch.bfloat16)), name, "dtype I8"


def truncated(folder):
    last = sorted(set(_index(folder)["weight_map"].values()))[-1]
    header, _ = read_header(folder / last)
    name = max(header, key=lambda n: header[n]["data_offsets"][1])
    data = (folder / last).read_bytes()
    (folder / last).write_bytes(data[:-100])
    return last, name, "truncated"


def shard_gone(folder):
    file = _shard_of(folder, "layers.20.attn.wkv.weight")
    (folder / file).unlink()
    first = next(n for n, f in _index(folder)["weight_map"].items() if f == file)
    return file, first, "no file"


def _random(b: bytes) -> bytes:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (len(b),), generator=g, dtype=torch.uint8).numpy().tobytes()


# the value checks as read (NaN, Inf, NaN codes), on folders whose digests list their odd bytes (resealed)

def random_bytes(folder):   # every byte of the first tensor read (BF16) random
    file = _patch_bytes(folder, "embed.weight", _random)
    reseal(folder)
    return file, "embed.weight", "non-finite"


def nan_scale(folder):
    name = "layers.7.ffn.shared_experts.w2.scale"
    file = _patch_bytes(folder, name, lambda b: b[:3] + b"\xff" + b[4:])
    reseal(folder)
    return file, name, "non-finite, first 255"


def config_disagrees(folder):   # config.json says a wider expert than the tensors hold
    doc = json.loads((folder / config_json.FILE).read_text())
    doc["text_config"]["moe_intermediate_size"] = 96
    (folder / config_json.FILE).write_text(json.dumps(doc))
    name = "layers.0.ffn.experts.0.w1.weight"
    return _shard_of(folder, name), name, "shape [96, 32]"


def _edit_header(folder, file, edit):
    """Rewrite one shard's JSON header with edit(header), keeping its data bytes as they are."""
    path = folder / file
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def _neighbours(folder, file):
    """Two tensors of a shard stored one after the other, the first at least 4 bytes long."""
    header, _ = read_header(folder / file)
    ordered = sorted(header, key=lambda n: header[n]["data_offsets"])
    return next((a, b) for a, b in zip(ordered, ordered[1:])
                if header[a]["data_offsets"][1] - header[a]["data_offsets"][0] >= 4)


def junk_appended(folder):
    file = _shard_of(folder, "head.weight")
    header, _ = read_header(folder / file)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    with open(folder / file, "ab") as f:
        f.write(b"\0" * 100)
    return file, last, "100 more bytes after it"


def overlapping_offsets(folder):   # b moved 2 bytes into a: both keep their sizes
    file = _shard_of(folder, "head.weight")
    a, b = _neighbours(folder, file)

    def edit(h):
        begin, end = h[b]["data_offsets"]
        start = h[a]["data_offsets"][0] + 2
        h[b]["data_offsets"] = [start, start + end - begin]
    _edit_header(folder, file, edit)
    return file, b, f"overlapping {a!r}"


def gap_between(folder):   # a shortened by 2 bytes (its shape with it) leaves unlisted bytes before b
    file = _shard_of(folder, "head.weight")
    a, b = _neighbours(folder, file)

    def edit(h):
        h[a]["data_offsets"][1] -= 2
    _edit_header(folder, file, edit)
    return file, b, f"2 unlisted bytes after {a!r}"


def metadata_not_string(folder):
    file = _shard_of(folder, "head.weight")
    _edit_header(folder, file, lambda h: h.update(__metadata__={"format": "pt", "step": 7}))
    return file, "__metadata__", "int 7"


def entry_not_object(folder):
    file = _shard_of(folder, "head.weight")
    _edit_header(folder, file, lambda h: h.update({"head.weight": [1, 2]}))
    return file, "head.weight", "found list"


def _point_index(folder, name, target):
    index = _index(folder)
    index["weight_map"][name] = target
    (folder / INDEX).write_text(json.dumps(index))


def index_leaves_folder(folder):   # the shard moved next to the folder, the index pointing at it
    file = _shard_of(folder, "head.weight")
    shutil.copy(folder / file, folder.parent / "outside.safetensors")
    _point_index(folder, "head.weight", "../outside.safetensors")
    return INDEX, "head.weight", "'../outside.safetensors', which is outside it"


def index_absolute_path(folder):
    file = _shard_of(folder, "head.weight")
    _point_index(folder, "head.weight", str((folder / file).resolve()))
    return INDEX, "head.weight", "which is outside it"


def symlink_leaves_folder(folder):   # a name inside the folder, a file outside it
    file = _shard_of(folder, "head.weight")
    shutil.copy(folder / file, folder.parent / "outside.safetensors")
    (folder / "linked.safetensors").symlink_to(folder.parent / "outside.safetensors")
    _point_index(folder, "head.weight", "linked.safetensors")
    return INDEX, "head.weight", "'linked.safetensors', which is outside it"


# DSpark's stages (mtp.*) are held to the same rules once any of them is listed


def dspark_missing(folder):   # one stage tensor gone while the others are listed: damaged, not "no DSpark"
    _rewrite(folder, "mtp.1.attn.wkv.scale", None)
    return INDEX, "mtp.1.attn.wkv.scale", "missing"


def dspark_wrong_shape(folder):   # a Markov head of another rank
    name = "mtp.2.markov_head.head.weight"
    return _rewrite(folder, name, _tensor(folder, name)[:, :16].contiguous()), name, "shape [512, 32]"


def dspark_nan_scale(folder):
    name = "mtp.0.ffn.experts.3.w2.scale"
    file = _patch_bytes(folder, name, lambda b: b"\xff" + b[1:])
    reseal(folder)
    return file, name, "non-finite, first 255"


# damage that every check above passes (issue 60, item 8): only the index's sha256 per tensor tells

def _twins(folder, file):
    """Two tensors of one shard with the same dtype and shape, in the order the index lists them."""
    header, _ = read_header(folder / file)
    order = list(_index(folder)["weight_map"])
    names = sorted(header, key=order.index)
    return next((a, b) for i, a in enumerate(names) for b in names[i + 1:]
                if (header[a]["dtype"], header[a]["shape"]) == (header[b]["dtype"], header[b]["shape"]))


def offsets_swapped(folder):   # two same-shaped tensors' data offsets swapped: each reads the other's bytes
    file = _shard_of(folder, "layers.4.ffn.experts.2.w1.weight")
    a, b = _twins(folder, file)

    def edit(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    _edit_header(folder, file, edit)
    return file, a, "sha256"


def random_fp4(folder):   # packed FP4: every byte is two finite values, so no value check can see it
    name = "layers.4.ffn.experts.2.w1.weight"
    return _patch_bytes(folder, name, _random), name, "sha256"


def unlisted_tensor(folder):   # a tensor in a shard that the index does not list
    file = _shard_of(folder, "head.weight")
    tensors = load_file(str(folder / file))
    tensors["layers.0.attn.extra"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(tensors, str(folder / file))
    return file, "layers.0.attn.extra", "a tensor it does not list here"


def finite_bit_flipped(folder):   # the lowest mantissa bit of one BF16 value: still finite, still plausible
    name = "layers.0.attn_norm.weight"
    return _patch_bytes(folder, name, lambda b: bytes([b[0] ^ 1]) + b[1:]), name, "sha256"


def digest_missing(folder):   # the table lists every tensor but one
    index = _index(folder)
    del index["sha256"]["layers.2.ffn.gate.weight"]
    (folder / INDEX).write_text(json.dumps(index))
    return INDEX, "layers.2.ffn.gate.weight", "a sha256 for every served tensor"


def digest_malformed(folder):
    index = _index(folder)
    index["sha256"]["norm.weight"] = "abc"
    (folder / INDEX).write_text(json.dumps(index))
    return INDEX, "norm.weight", "64 lowercase hex digits, found 'abc'"


DAMAGES = [missing, extra, wrong_shape, uint8_for_fp8, bf16_for_fp4, truncated, shard_gone, random_bytes,
           nan_scale, config_disagrees, junk_appended, overlapping_offsets, gap_between, metadata_not_string,
           entry_not_object, index_leaves_folder, index_absolute_path, symlink_leaves_folder,
           dspark_missing, dspark_wrong_shape, dspark_nan_scale,
           offsets_swapped, random_fp4, unlisted_tensor, finite_bit_flipped, digest_missing, digest_malformed]
CHECKSUM_DAMAGES = [offsets_swapped, random_fp4, finite_bit_flipped]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__ for d in DAMAGES])
def test_damaged_checkpoint_is_refused_before_any_step(capsys, tiny_checkpoint, tmp_path, damage):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    file, tensor, found = damage(folder)
    rc = main(["--checkpoint", str(folder), "--prompt", "hello", "--executor", "sync", "--tp", "1", "--dp", "1",
               "--new-tokens", "1"])
    out, err = capsys.readouterr()
    assert rc == 2 and "prefill" not in out + err and "tokens" not in out
    assert err.startswith("python -m dsv41.run: error: --checkpoint: ")
    assert f"{file}: tensor {tensor!r}" in err and found in err, err


RUN = ["--prompt", "hello", "--executor", "sync", "--tp", "1", "--dp", "1", "--new-tokens", "1"]


@pytest.mark.parametrize("damage", CHECKSUM_DAMAGES, ids=[d.__name__ for d in CHECKSUM_DAMAGES])
def test_only_the_checksums_see_this_damage(capsys, tiny_checkpoint, tmp_path, damage):
    """--no-verify-checksums serves it: every other check passes it (so the digest is what refuses it)."""
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    damage(folder)
    assert main(["--checkpoint", str(folder), *RUN, "--no-verify-checksums"]) == 0
    assert "error" not in capsys.readouterr().err


def test_the_writer_lists_each_tensors_sha256(tiny_checkpoint):
    """The index's table is the SHA-256 of each tensor's bytes as safetensors loads them, one per tensor."""
    index = _index(tiny_checkpoint)
    assert set(index["sha256"]) == set(index["weight_map"])
    for file in set(index["weight_map"].values()):
        for name, t in load_file(str(tiny_checkpoint / file)).items():
            raw = t.contiguous().view(torch.uint8).numpy().tobytes()
            assert hashlib.sha256(raw).hexdigest() == index["sha256"][name], name


def test_an_index_without_digests_is_served_with_one_warning(capsys, tiny_checkpoint, tmp_path):
    """As the released checkpoint's index (Hugging Face's) is: served, and the run says what is not checked."""
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    index = _index(folder)
    del index["sha256"]
    (folder / INDEX).write_text(json.dumps(index))
    assert main(["--checkpoint", str(folder), *RUN]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"python -m dsv41.run: warning: --checkpoint: {folder / INDEX} lists no sha256 per tensor, "
                        "so damaged bytes that are still valid values cannot be told apart "
                        "(python -m dsv41.checkpoint.write lists them)"]
    assert main(["--checkpoint", str(folder), *RUN, "--no-verify-checksums"]) == 0
    assert "warning" not in capsys.readouterr().err


def _config_doc(folder):
    return json.loads((folder / config_json.FILE).read_text())


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.pop("hidden_size"), "text_config.hidden_size: expected present"),
    (lambda t: t.update(num_hidden_layers=True), "text_config.num_hidden_layers: expected an integer"),
    (lambda t: t.update(compress_ratios=t["compress_ratios"] + [1]), "text_config.compress_ratios"),
    (lambda t: t.update(engram_num_embeddings=[5, 6]), "text_config.engram_num_embeddings"),
    (lambda t: t.update(scoring_func="softmax"), "text_config.scoring_func"),
    (lambda t: t["rope_scaling"].pop("factor"), "text_config.rope_scaling.factor"),
    (lambda t: t.update(o_groups=3), "o_groups: must divide num_attention_heads"),
    # numbers in range: each of these ran before and served NaN/Inf logits as tokens
    (lambda t: t.update(rms_norm_eps=-1), "text_config.rms_norm_eps: must be a finite number > 0, got -1.0"),
    (lambda t: t.update(rms_norm_eps=0), "text_config.rms_norm_eps: must be a finite number > 0, got 0.0"),
    (lambda t: t.update(rope_theta=float("nan")), "text_config.rope_theta: expected a finite number, found nan"),
    (lambda t: t.update(compress_rope_theta=float("inf")), "text_config.compress_rope_theta: expected a finite"),
    (lambda t: t.update(compress_rope_theta=-5), "text_config.compress_rope_theta: must be a finite number > 0"),
    (lambda t: t["rope_scaling"].update(factor=0), "text_config.rope_scaling.factor: must be a finite number > 0"),
    (lambda t: t["rope_scaling"].update(beta_slow=40), "text_config.rope_scaling.beta_fast: YaRN needs 0 < beta_slow"),
    (lambda t: t.update(hc_eps=-1e-6), "text_config.hc_eps: must be a finite number > 0"),
    (lambda t: t.update(hidden_size=2 ** 40), "text_config.hidden_size: must be in [1, 2147483647]"),
    (lambda t: t.update(engram_n_heads=0), "text_config.engram_n_heads: must be in [1, 2147483647], got 0"),
])
def test_config_json_must_agree_with_itself(tiny_checkpoint, edit, field):
    doc = _config_doc(tiny_checkpoint)
    edit(doc["text_config"])
    with pytest.raises(CheckpointError, match="config.json: .*" + field.split(":")[0]) as e:
        config_json.from_json(doc, "x")
    assert field in str(e.value)


def test_released_style_config_is_read(tiny_checkpoint):
    """No dsv41 section (engine constants default), draft-layer ratios appended, FLASH round trip."""
    doc = config_json.to_json(config_json.from_json(_config_doc(tiny_checkpoint), "x"))
    del doc["dsv41"]
    # TINY's three DSpark stages are written as the released file lists draft layers: a 0 ratio each
    assert doc["text_config"]["num_nextn_predict_layers"] == 3
    assert doc["text_config"]["compress_ratios"] == list(TINY.compress_ratios) + [0] * 3
    del doc["text_config"]["candidate_source_layer_id"]     # defaults to the last KV source
    cfg = config_json.from_json(doc, "folder")
    assert cfg.name == "folder" and cfg.compress_ratios == TINY.compress_ratios and cfg.block_size == 128
    assert cfg.candidate_source_layer_id == 20
    for preset in (TINY, SMALL, FLASH):
        assert config_json.from_json(json.loads(json.dumps(config_json.to_json(preset))), "x") == preset
    assert config_json.to_json(FLASH)["text_config"]["engram_num_embeddings"] == [384006168, 384016682]


def test_tokenizer_must_give_the_configs_compressed_vocabulary(tiny_checkpoint, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    doc = _config_doc(folder)
    doc["text_config"]["engram_compressed_vocab_size"] += 1
    (folder / config_json.FILE).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="tokenizer.json: expected config.json's engram_compressed_vocab_size"):
        open_checkpoint(folder)
