"""--check: every node against the Torch golden on its own inputs; first failure saved and replayable."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import TINY, Topology
from dsv41.kernels import check
from dsv41.cli.replay import replay
from dsv41.kernels.kinds import KINDS
from dsv41.run import main


def test_check_torch_backend_every_node_exact(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--check", "--executor", "sync", "--tp", "2", "--dp", "1", "--batch", "2", "--prompt-len", "9",
                 "--new-tokens", "2", "--json"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    kernels = result["check"]["kernels"]
    assert result["check"]["first_failure"] is None and "every node passed" in out.err
    assert {"hc.post", "attn.leaf.swa", "attn.topk", "moe.gate", "tp.reduce_scatter", "lm_head.argmax"} <= set(kernels)
    for name, row in kernels.items():
        assert row["nodes"] > 0 and row["failures"] == 0 and row["exact"] == row["nodes"], name
    assert "attn.publish" not in kernels and "cache.commit" not in kernels   # effects are not run twice


def test_perturbed_kernel_is_the_first_failure_and_replays(tmp_path):
    target = "L5/ffn/norm@c0"
    engine = GraphEngine(TINY, Topology(1, 1, 1), EngineConfig(seed=0, executor="sync", max_batch=2, max_context=32))
    checker = check.NodeCheck("torch", trace_dir=tmp_path)
    original = KINDS["norm.rms"]

    def perturbed(st, node, x):
        y = original.run(st, node, x)
        return y + 0.05 * y.pow(2).mean(-1, keepdim=True).sqrt() if node.key == target else y

    engine.check_nodes(checker)
    KINDS["norm.rms"] = dataclasses.replace(original, run=perturbed)
    try:
        engine.prefill([[1, 2, 3, 4, 5], [9, 8, 7]])
    finally:
        KINDS["norm.rms"] = original
        engine.check_nodes(None)
    first = checker.first_failure
    assert first["node"] == target and first["kernel"] == "norm.rms"
    assert "RMS(err)/RMS(ref)" in first["why"]
    assert checker.rows["norm.rms"].failures == 1                   # downstream goldens use the perturbed inputs
    assert sum(r.failures for r in checker.rows.values()) == 1
    saved, verdict = replay(first["trace"])
    assert saved["node"].key == target and not verdict.ok
    assert verdict.rms_ratio == pytest.approx(0.05, rel=0.05)
    assert replay(first["trace"], rerun=True)[1].ok                  # the unperturbed kernel passes


@pytest.mark.timeout(120)
def test_replay_command_exit_status(tmp_path):
    engine = GraphEngine(TINY, Topology(1, 1, 1), EngineConfig(seed=0, executor="sync", max_batch=1, max_context=16))
    checker = check.NodeCheck("torch", trace_dir=tmp_path)
    key = "L0/attn/norm@c0"
    original = KINDS["norm.rms"]
    KINDS["norm.rms"] = dataclasses.replace(
        original, run=lambda st, node, x: original.run(st, node, x) * (1.5 if node.key == key else 1.0))
    engine.check_nodes(checker)
    try:
        engine.prefill([[3, 1, 4]])
    finally:
        KINDS["norm.rms"] = original
        engine.check_nodes(None)
    proc = subprocess.run([sys.executable, "-m", "dsv41.replay", checker.first_failure["trace"]],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1 and f"{key} (norm.rms" in proc.stdout and "FAILS" in proc.stdout


def test_compare_rules():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert check.compare(a, a.clone()).exact
    v = check.compare(a * (1 + 0.009), a)                            # inside the 1% RMS bound
    assert v.ok and not v.exact and v.rms_ratio == pytest.approx(0.009, rel=1e-3)
    assert not check.compare(a * 1.02, a).ok
    assert not check.compare(torch.tensor([1, 2]), torch.tensor([1, 3])).ok    # integers: exact
    assert not check.compare((a, torch.tensor([True])), (a, torch.tensor([False]))).ok
    assert not check.compare(torch.tensor([[float("nan"), 1.0]]), torch.tensor([[0.0, 1.0]])).ok


@pytest.mark.parametrize("per_shape", [1, 0])
def test_pypto_values_for_the_first_nodes_of_each_kernel_and_shape(monkeypatch, tmp_path, per_shape):
    """--pypto-per-shape N: pypto's value for the first N nodes of each (node kind, kernel shape), the
    rest checked on their Torch value; 0: every node. pypto itself is stood in for by the golden."""
    calls = []

    def fake_pypto(mode, st, node, args, memo=None, request=None):
        calls.append((node.kernel, check.shape_key(*request[:3])))
        return KINDS[node.kernel].run(st, node, *args)
    monkeypatch.setattr(check, "pypto_value", fake_pypto)
    engine = GraphEngine(TINY, Topology(2, 1, 2), EngineConfig(seed=0, executor="sync", max_batch=2, max_context=32))
    checker = check.NodeCheck("pypto-sim", pypto_per_shape=per_shape, trace_dir=tmp_path)
    engine.check_nodes(checker)
    try:
        out = engine.prefill([[1, 2, 3, 4, 5], [9, 8, 7]])
        engine.decode(out.last)
    finally:
        engine.check_nodes(None)
    forms = {k for k, kind in KINDS.items() if kind.pypto is not None}
    assert checker.first_failure is None
    for name, row in checker.rows.items():
        assert row.source == ("pypto" if name in forms else "torch")
        if name not in forms:
            assert row.pypto_nodes == 0
        elif per_shape:
            assert 0 < row.pypto_nodes < row.nodes, (name, vars(row))
        else:
            assert row.pypto_nodes == row.nodes, (name, vars(row))
    if per_shape:
        assert len(set(calls)) == len(calls)       # once per (node kind, kernel shape)
    assert len(calls) == sum(r.pypto_nodes for r in checker.rows.values())


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_check_pypto_sim_lists_every_pypto_kernel(capsys):
    assert main(["--check", "--backend", "pypto-sim", "--executor", "sync", "--tp", "1", "--dp", "1",
                 "--batch", "1", "--prompt-len", "5", "--graph", "prefill", "--json"]) == 0
    out = capsys.readouterr()
    kernels = json.loads(out.out)["check"]["kernels"]
    forms = [name for name, kind in KINDS.items() if kind.pypto is not None]
    for name in forms:
        assert kernels[name]["source"] == "pypto" and kernels[name]["nodes"] > 0, name
        assert kernels[name]["failures"] == 0, (name, kernels[name])
    for name, kind in KINDS.items():
        assert not kind.no_pypto or f"{name} " in out.err, name
