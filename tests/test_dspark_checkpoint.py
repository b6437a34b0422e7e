"""DSpark's stages in checkpoint folders: written as ``mtp.*``, read and checked like every tensor,
and a folder without them serving the backbone alone, saying so when DSpark is asked for."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.checkpoint import config_json
from dsv41.checkpoint.errors import CheckpointError
from dsv41.checkpoint.headers import INDEX
from dsv41.checkpoint.reader import open_checkpoint
from dsv41.config import FLASH, TINY
from dsv41.run import main
from dsv41.weights import checkpoint_specs, init_checkpoint
from checkpoint_edits import reseal


def _mtp(names):
    return sorted(n for n in names if n.startswith("mtp."))


def test_the_writer_writes_every_stage_tensor_and_the_reader_serves_them(tiny_checkpoint):
    ck = open_checkpoint(tiny_checkpoint)
    assert ck.has_dspark and ck.cfg.n_mtp_layers == 3
    ck.require_dspark()   # nothing to refuse
    want = _mtp(checkpoint_specs(ck.cfg))
    # the names the official module tree gives: stage 0's input map, the last stage's heads
    assert {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
            "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
            "mtp.2.confidence_head.proj.weight", "mtp.1.ffn.experts.15.w3.weight", "mtp.1.attn.attn_sink",
            "mtp.2.hc_ffn_base"} <= set(want)
    # per stage: 6 mHC, 2 norms, 13 attention (5 FP8 linears with scales, 2 norms, sinks), gate weight and
    # bias, 16 experts x 3 FP4 linears with scales, 3 FP8 shared linears with scales; + 3 input map, 4 heads
    assert _mtp(ck.names()) == want and len(want) == 3 * (6 + 2 + 13 + 2 + 16 * 3 * 2 + 3 * 2) + 3 + 4
    drawn = init_checkpoint(ck.cfg, 0)
    for name in ("mtp.0.main_proj.weight", "mtp.2.markov_head.embed.weight", "mtp.1.ffn.experts.4.w1.weight"):
        assert torch.equal(ck.get(name).view(torch.uint8), drawn[name].view(torch.uint8)), name
    assert ck.get("mtp.2.confidence_head.proj.weight").shape == (1, TINY.hidden_size + TINY.dspark_markov_rank)


def _strip_mtp(folder):
    """Every mtp.* tensor out of the index and its shard."""
    index = json.loads((folder / INDEX).read_text())
    for file in set(index["weight_map"].values()):
        tensors = load_file(str(folder / file))
        kept = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
        if len(kept) != len(tensors):
            save_file(kept, str(folder / file))
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith("mtp.")}
    (folder / INDEX).write_text(json.dumps(index))
    reseal(folder)      # a folder written without DSpark lists no digests for it


def _logits_sha(capsys, folder):
    assert main(["--checkpoint", str(folder), "--prompt", "the river", "--executor", "sync", "--tp", "1",
                 "--dp", "1", "--new-tokens", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["last_logits_sha256"]


def test_a_folder_without_stages_serves_the_backbone_and_refuses_dspark_in_one_line(capsys, tiny_checkpoint,
                                                                                   tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(tiny_checkpoint, folder)
    _strip_mtp(folder)
    ck = open_checkpoint(folder)
    assert not ck.has_dspark and ck.declared.n_mtp_layers == 3 and _mtp(ck.names()) == []
    with pytest.raises(CheckpointError) as e:
        ck.require_dspark()
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{folder}: expected DSpark draft stages (mtp.*)")
    assert "found no mtp.* tensors in model.safetensors.index.json (config.json declares 3 stages)" in line
    # plain generation is the same with or without the stages in the folder
    assert _logits_sha(capsys, folder) == _logits_sha(capsys, tiny_checkpoint)
    # and the command line refuses DSpark drafting on it in one line, exit status 2
    assert main(["--checkpoint", str(folder), "--prompt", "the river", "--speculative", "dspark"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "expected DSpark draft stages (mtp.*)" in err and "Traceback" not in err


def test_stages_a_config_does_not_declare_are_skipped(tiny_checkpoint, tmp_path):
    folder = tmp_path / "undeclared"
    shutil.copytree(tiny_checkpoint, folder)
    doc = json.loads((folder / config_json.FILE).read_text())
    text = doc["text_config"]
    for key in [k for k in text if k.startswith("dspark_")]:
        del text[key]
    text["num_nextn_predict_layers"] = 0
    text["compress_ratios"] = text["compress_ratios"][:TINY.num_hidden_layers]
    (folder / config_json.FILE).write_text(json.dumps(doc))
    ck = open_checkpoint(folder)
    assert not ck.has_dspark and not ck.declared.dspark and _mtp(ck.names()) == []
    with pytest.raises(CheckpointError, match="found none declared"):
        ck.require_dspark()


def test_config_json_round_trips_dspark_and_names_a_missing_key():
    text = config_json.to_json(FLASH)["text_config"]
    assert (text["num_nextn_predict_layers"], text["dspark_block_size"], text["dspark_noise_token_id"],
            text["dspark_target_layer_ids"], text["dspark_markov_rank"], text["dspark_n_routed_experts"],
            text["dspark_num_experts_per_tok"]) == (3, 5, 128799, [37, 38, 39], 256, 128, 3)
    assert text["compress_ratios"][40:] == [0, 0, 0]     # the stages' window-only attention, as released
    for cfg in (FLASH, TINY):
        assert config_json.from_json(json.loads(json.dumps(config_json.to_json(cfg))), "x") == cfg
    doc = config_json.to_json(FLASH)
    t = doc["text_config"]
    t["dspark_n_activated_experts"] = t.pop("dspark_num_experts_per_tok")   # the official inference code's key
    assert config_json.from_json(doc, "x").dspark_n_activated_experts == 3
    del t["dspark_markov_rank"]
    with pytest.raises(CheckpointError, match="text_config.dspark_markov_rank: expected present"):
        config_json.from_json(doc, "x")
    doc = config_json.to_json(FLASH)
    doc["text_config"]["dspark_noise_token_id"] = 129280
    with pytest.raises(CheckpointError, match=r"text_config.dspark_noise_token_id: must be in \[0, 129279\]"):
        config_json.from_json(doc, "x")
