"""Reduced models through the test-checkpoint writer: the folder's config.json is the reduced config,
the tensors are the reduced model's, and the writer refuses what a run refuses."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dsv41.checkpoint.reader import open_checkpoint, read_config
from dsv41.capacity import CAPACITIES
from dsv41.cli.write_checkpoint import main
from dsv41.config import TINY
from dsv41.weights import checkpoint_specs


def test_the_writer_writes_a_reduced_model_whose_config_round_trips(tmp_path, capsys):
    folder = tmp_path / "ck"
    assert main([str(folder), "--config", "tiny", "--layers", "3", "--experts", "8", "--engram-rows", "101",
                 "--shard-mb", "0.5"]) == 0
    want = TINY.reduced(layers=3, experts=8, engram_rows=101)
    got, capacity = read_config(folder)
    assert got.name == "tiny-L3-E8-R101" == want.name
    assert capacity == CAPACITIES["tiny"]               # the reduction runs with its preset's limits
    assert got == replace(want, engram_compressed_vocab_size=got.engram_compressed_vocab_size)
    opened = open_checkpoint(folder)                 # every header checked against the reduced model
    assert set(opened.names()) == set(checkpoint_specs(got))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    assert "tiny-L3-E8-R101" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [(["--layers", "41"], "--layers: must be in [1, 40]"),
                                        (["--experts", "4"], "--experts: must be in [6, 16]")])
def test_the_writer_refuses_bad_reductions(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "ck"), "--config", "tiny", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()
