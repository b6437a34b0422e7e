"""PyPTO backend. The default tests never start pypto (a fake simulator stands in); the real SIM and
pass-verify runs are marked slow: pytest -m slow tests/test_pypto_backend.py"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from dsv41.config import FLASH, TINY
from dsv41.capacity import CAPACITIES
from dsv41.kernels.pypto import env as pypto_env
from dsv41.kernels.pypto.backend import (PYPTO_KERNELS, SimCache, cache_key, check_npu, device_time_us,
                                         node_parts, node_time_us, sim_time_us, verify_kernel)
from dsv41.kernels.pypto.specs import kernel_digest
from dsv41.kernels.pypto.verify import row_check
from dsv41.kernels.pypto.worker import e2e_us
from dsv41.ops.rope import apply_rope

REQUIRED = ["norm.rms", "rope.rows", "rope.apply", "hc.pre", "hc.post", "matmul", "attn.q_proj",
            "attn.kv_proj", "attn.o_proj", "lm_head.shard", "moe.gate", "attn.softmax_tile"]


class FakeSim:
    def __init__(self, us=3.5, fail=None):
        self.calls, self.us, self.fail = [], us, fail

    def __call__(self, kernel, shapes, dtypes):
        self.calls.append((kernel, dict(shapes), dict(dtypes)))
        if self.fail:
            raise self.fail
        return self.us + len(self.calls)


def test_registry_has_the_graph_names():
    assert set(REQUIRED) <= set(PYPTO_KERNELS)
    for name, spec in PYPTO_KERNELS.items():
        assert spec.name == name and callable(spec)
        s, _ = spec.normalize(spec.example)
        outs = [a for a in spec.args(s) if a.kind == "out"]
        assert outs, name
        inputs = spec.random_inputs(s)
        assert set(spec.golden({a.name: t for a, t in zip(spec.args(s), spec.to_layout(inputs, s))
                                if a.kind != "out"}, *spec.normalize(s))) == {a.name for a in outs}


def test_cache_memory_then_disk_then_no_resimulation(tmp_path):
    path = tmp_path / "sim.json"
    fake = FakeSim()
    shapes = dict(T=8, D=64)
    cache = SimCache(path)
    first = sim_time_us("norm.rms", shapes, cache=cache, simulate=fake)
    assert first == 4.5 and len(fake.calls) == 1
    assert fake.calls[0][1] == {"T": 8, "D": 64, "eps": 1e-20}  # normalized before simulating
    assert sim_time_us("norm.rms", shapes, cache=cache, simulate=fake) == first
    assert len(fake.calls) == 1
    # a fresh cache object (= a second process) reads the file and simulates nothing
    again = SimCache(path)
    assert sim_time_us("norm.rms", dict(D=64, T=8), cache=again, simulate=fake) == first
    assert len(fake.calls) == 1
    data = json.loads(path.read_text())
    assert data[cache_key("norm.rms", shapes)]["us"] == first
    # other shapes, dtypes or mode are other keys
    sim_time_us("norm.rms", dict(T=16, D=64), cache=again, simulate=fake)
    sim_time_us("norm.rms", shapes, {"act": "fp16"}, cache=again, simulate=fake)
    sim_time_us("norm.rms", shapes, mode="npu", cache=again, simulate=fake)
    assert len(fake.calls) == 4
    assert len(json.loads(path.read_text())) == 4


def test_two_caches_on_one_file_merge(tmp_path):
    path = tmp_path / "sim.json"
    a, b = SimCache(path), SimCache(path)
    sim_time_us("norm.rms", dict(T=8, D=64), cache=a, simulate=FakeSim())
    sim_time_us("hc.pre", dict(T=8, hc=4, D=64), cache=b, simulate=FakeSim())
    assert len(json.loads(path.read_text())) == 2


def test_failure_returns_none_and_is_recorded(tmp_path):
    path = tmp_path / "sim.json"
    cache = SimCache(path)
    fake = FakeSim(fail=RuntimeError("exceeds MEM_UB"))
    assert sim_time_us("hc.post", dict(T=8, hc=4, D=64), cache=cache, simulate=fake) is None
    assert sim_time_us("hc.post", dict(T=8, hc=4, D=64), cache=SimCache(path), simulate=fake) is None
    assert len(fake.calls) == 1
    assert list(cache.errors().values()) == ["exceeds MEM_UB"]


def test_transient_failure_is_not_persisted(tmp_path):
    from dsv41.kernels.pypto.sim import SimFailed
    path = tmp_path / "sim.json"
    fake = FakeSim(fail=SimFailed("pypto worker timed out", transient=True))
    assert sim_time_us("hc.pre", dict(T=8, hc=4, D=64), cache=SimCache(path), simulate=fake) is None
    ok = FakeSim()
    assert sim_time_us("hc.pre", dict(T=8, hc=4, D=64), cache=SimCache(path), simulate=ok) is not None
    assert len(ok.calls) == 1


def test_unknown_kernel_is_none_and_bad_shapes_raise(tmp_path):
    fake = FakeSim()
    assert sim_time_us("attn.leaf.swa", {"T": 1}, cache=SimCache(tmp_path / "c.json"), simulate=fake) is None
    with pytest.raises(ValueError, match="missing"):
        sim_time_us("norm.rms", {"T": 8}, cache=SimCache(tmp_path / "c.json"), simulate=fake)
    with pytest.raises(ValueError, match="dtype"):
        sim_time_us("norm.rms", {"T": 8, "D": 64}, {"act": "fp8"}, cache=SimCache(tmp_path / "c.json"),
                    simulate=fake)
    assert fake.calls == []


def test_node_parts_cover_registered_kernels_and_sum(tmp_path):
    for cfg, rows, tp in [(TINY, CAPACITIES["tiny"].decode_max_tokens, 1),
                          (FLASH, CAPACITIES["flash"].decode_max_tokens, 4)]:
        for node, parts in node_parts(cfg, rows, tp).items():
            for kernel, shapes in parts:
                PYPTO_KERNELS[kernel].normalize(shapes)
    fake = FakeSim(us=1.0)
    t = node_time_us("attn.q_proj", TINY, 48, cache=SimCache(tmp_path / "c.json"), simulate=fake)
    assert t == sum(1.0 + i for i in range(1, len(fake.calls) + 1)) and len(fake.calls) == 4
    assert node_time_us("cache.commit", TINY, 48, simulate=fake) is None


def test_attention_leaf_parts_cover_all_keys_in_one_call():
    h = FLASH.num_attention_heads // 4
    parts = node_parts(FLASH, 192, 4, 8)
    for mode, keys in (("swa", FLASH.sliding_window), ("c2a_full", FLASH.sliding_window + FLASH.index_topk),
                       ("c1a_reuse", FLASH.sliding_window + FLASH.index_topk)):
        leaf = dict(parts[f"attn.leaf.{mode}"])
        assert leaf["attn.qk_tile"] == leaf["attn.pv_tile"] == dict(T=192, H=h, K=keys, d=FLASH.head_dim)
        assert leaf["attn.softmax_tile"] == dict(R=192 * h, K=keys)


def test_check_npu_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(RuntimeError, match=r"pypto-npu needs an Ascend NPU and torch_npu: "):
        check_npu()
    fake = FakeSim()
    with pytest.raises(RuntimeError, match="pypto-npu needs"):
        device_time_us("pypto-npu", "norm.rms", dict(T=8, D=64), simulate=fake)
    assert fake.calls == []
    with pytest.raises(ValueError, match="backend"):
        device_time_us("torch", "norm.rms", dict(T=8, D=64), simulate=fake)


def test_device_time_us_sim_backend(tmp_path):
    fake = FakeSim()
    assert device_time_us("pypto-sim", "norm.rms", dict(T=8, D=64), cache=SimCache(tmp_path / "c.json"),
                          simulate=fake) == 4.5


def test_cache_key_tracks_kernel_code_not_comments():
    k = cache_key("norm.rms", dict(T=8, D=64))
    assert k.startswith("norm.rms|D=64,T=8,eps=1e-20|act=bf16,w=bf16|sim|r1-")
    assert kernel_digest("rms_norm") != kernel_digest("matmul")
    assert cache_key("attn.q_proj", dict(M=1, K=2, N=3)).split("|")[-1] == \
        cache_key("matmul", dict(M=1, K=2, N=3)).split("|")[-1]  # aliases share the factory


@pytest.mark.parametrize("inverse", [0, 1])
@pytest.mark.parametrize("dim,half", [(64, 8), (16, 8)])
def test_rope_index_tables_reproduce_apply_rope(inverse, dim, half):
    """The kernel's formula y = x*C + x[:, swap]*S, evaluated in Torch with the same tables."""
    spec = PYPTO_KERNELS["rope.apply"]
    s = dict(T=5, H=3, dim=dim, half=half, inverse=inverse)
    c = spec.consts(spec.normalize(s)[0])
    x = torch.randn(5, 3, dim).bfloat16().float()
    cos, sin = torch.randn(5, half), torch.randn(5, half)
    rows = x.reshape(15, dim)
    nope = dim - 2 * half
    xr = rows[:, nope:]
    C = cos[c["row"].long()][:, c["rep"].long()]
    S = sin[c["row"].long()][:, c["rep"].long()] * c["sign"]
    y = torch.cat([rows[:, :nope], xr * C + xr[:, c["swap"].long()] * S], -1)
    ref = apply_rope(x, cos, sin, inverse=bool(inverse)).reshape(15, dim)
    assert torch.equal(y.bfloat16().float(), ref)


def test_row_check_accepts_exact_and_rejects_zeros():
    ref = torch.randn(4, 32)
    assert row_check(ref.clone(), ref)["ok"]
    assert not row_check(torch.zeros_like(ref), ref)["ok"]
    bad = ref.clone()
    bad[2, 0] = float("nan")
    assert not row_check(bad, ref)["ok"]


def test_e2e_us_from_swimlane(tmp_path):
    sim = tmp_path / "CostModelSimulationOutput"
    sim.mkdir()
    sw = [{"blockIdx": 0, "coreType": "AIC", "tasks": [{"execStart": 1800, "execEnd": 5400}]},
          {"blockIdx": 1, "coreType": "AIV", "tasks": [{"execStart": 3600, "execEnd": 9000}]},
          {"blockIdx": 2, "coreType": "HUB", "tasks": [{"execStart": 0, "execEnd": 99999}]}]
    (sim / "_simulate.swim.json").write_text(json.dumps(sw))
    assert e2e_us(tmp_path) == (4.0, 2)


def test_backend_import_does_not_import_pypto():
    code = "import sys, dsv41.kernels.pypto.backend; assert 'pypto' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_run_dir_is_configurable(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV41_PYPTO_RUN_DIR", str(tmp_path / "run"))
    assert pypto_env.run_dir() == (tmp_path / "run").resolve()
    env = pypto_env.worker_env(pypto_env.run_dir())
    assert all(v.startswith(str(tmp_path)) for v in env.values())
    shim = pypto_env.python3_shim(tmp_path)
    assert subprocess.run([str(shim / "python3"), "-c", "print(1)"], capture_output=True).stdout == b""


# ---- real pypto (slow) ---------------------------------------------------------------------------

@pytest.mark.slow
def test_real_sim_rms_norm_and_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_PYPTO_RUN_DIR", str(tmp_path / "run"))  # a worker of its own
    path = tmp_path / "sim.json"
    us = sim_time_us("norm.rms", dict(T=16, D=256), cache=SimCache(path))
    assert us is not None and math.isfinite(us) and us > 0
    assert json.loads(path.read_text())[cache_key("norm.rms", dict(T=16, D=256))]["us"] == us

    def never(*a):
        raise AssertionError("simulated again")
    assert sim_time_us("norm.rms", dict(T=16, D=256), cache=SimCache(path), simulate=never) == us
    assert not list((tmp_path / "run" / "out").glob("output_*"))  # removed after reading
    assert not list(tmp_path.glob("output*")) and (tmp_path / "run" / "log").is_dir()


def test_w8a8_expert_golden_is_the_swiglu_of_its_dequantized_weights():
    """The routed experts' W8A8 golden against float64 SwiGLU on w_int8 * scale with unquantized
    activations. They differ by the two per-row INT8 activation roundings (uniform within +-absmax/254
    per element: absmax / (254 rms sqrt 3), 1-2% of a row's norm for these randn / SwiGLU rows, per
    stage) and the BF16 output, so within 5% per row; a wrong scale axis or transpose is O(1) off."""
    spec = PYPTO_KERNELS["moe.experts"]
    shapes = dict(G=3, T=8, D=256, I=64)
    i = spec.random_inputs(shapes, seed=5)
    i["weight"] = torch.ones_like(i["weight"])
    out = spec.golden(i, *spec.normalize(shapes))["y"].double()
    x = i["x"].double()
    w1, w3, w2 = (i[k].double() * i[s].double().transpose(1, 2) for k, s in (("w1", "s1"), ("w3", "s3"), ("w2", "s2")))
    g = (x @ w1.transpose(1, 2)).clamp(max=10.0)
    u = (x @ w3.transpose(1, 2)).clamp(-10.0, 10.0)
    ref = (g * torch.sigmoid(g) * u) @ w2.transpose(1, 2)
    rel = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 0.05, rel.max()
    assert spec.dtypes["w"] == "int8" and PYPTO_KERNELS["moe.shared"].dtypes["w"] == "bf16"


class LinearSim(FakeSim):
    """µs = fill + per_entry * G: the shape sliced pricing assumes, so it must come back exact."""

    def __call__(self, kernel, shapes, dtypes):
        self.calls.append((kernel, dict(shapes), dict(dtypes)))
        return 40.0 + 30.0 * shapes["G"]


def test_grouped_experts_priced_from_two_slices_never_whole(tmp_path):
    from dsv41.kernels.pypto.sim import SIM_SLICE
    cache, fake = SimCache(tmp_path / "sim.json"), LinearSim()
    shapes = dict(G=48, T=16, D=256, I=64)
    assert sim_time_us("moe.experts", shapes, cache=cache, simulate=fake) == 40.0 + 30.0 * 48
    asked = [(c[1]["G"], c[1]["group"]) for c in fake.calls]
    assert asked == [(SIM_SLICE, 48), (2 * SIM_SLICE, 48)]  # slices only, tiled as the whole group
    assert sim_time_us("moe.experts", shapes, cache=SimCache(tmp_path / "sim.json"), simulate=fake) == 1480.0
    assert len(fake.calls) == 2  # the whole call's value is cached under its own key
    # small groups are simulated whole; a failed slice makes the whole call None
    sim_time_us("moe.experts", dict(shapes, G=2 * SIM_SLICE), cache=cache, simulate=fake)
    assert fake.calls[-1][1]["G"] == 2 * SIM_SLICE and fake.calls[-1][1]["group"] == 0
    assert sim_time_us("moe.shared", dict(shapes, G=32), cache=cache, simulate=FakeSim(fail=RuntimeError("x"))) is None
    sim_time_us("moe.experts", shapes, mode="npu", cache=cache, simulate=fake)  # a device measures it whole
    assert fake.calls[-1][1]["G"] == 48


@pytest.mark.slow
def test_real_failure_leaves_caller_alive(tmp_path):
    cache = SimCache(tmp_path / "sim.json")
    assert sim_time_us("hc.pre", dict(T=8, hc=3, D=64), cache=cache) is None  # odd hc: factory refuses
    assert "hc must be even" in next(iter(cache.errors().values()))
    assert sim_time_us("norm.rms", dict(T=8, D=64), cache=cache) > 0  # the worker was restarted


@pytest.mark.slow
def test_worker_past_its_rss_cap_retires_after_replying(monkeypatch):
    """pypto keeps each call's compiled kernel loaded; a worker over DSV41_PYPTO_WORKER_MAX_GB answers,
    then exits, and the next call gets a fresh worker (memory stays bounded over thousands of calls)."""
    from dsv41.kernels.pypto.sim import PyptoWorker
    monkeypatch.setenv("DSV41_PYPTO_WORKER_MAX_GB", "0")
    w = PyptoWorker("sim")
    shapes, dtypes = PYPTO_KERNELS["norm.rms"].normalize(dict(T=8, D=64))
    try:
        first = w.run("norm.rms", shapes, dtypes)
        assert first["ok"] and first["us"] > 0 and "retire" not in first and w._proc is None
        second = w.run("norm.rms", shapes, dtypes)
        assert second["ok"] and w._proc is None
        # the started worker names the chip it simulates: the arch the bench writes beside each row
        assert pypto_env.NPU_ARCHS[w.arch] == pypto_env.SIM_ARCH
    finally:
        w.close()


@pytest.mark.slow
def test_worker_killed_mid_call_is_reported_and_replaced(tmp_path):
    """A worker that dies (segfault, exit(1)) mid-call: the caller gets None and the next call works."""
    import os
    import signal
    import threading
    from dsv41.kernels.pypto.sim import worker
    w = worker("sim")
    cache = SimCache(tmp_path / "sim.json")
    assert sim_time_us("norm.rms", dict(T=8, D=64), cache=cache) > 0  # worker is up
    pid = w._proc.pid
    threading.Timer(0.3, os.kill, (pid, signal.SIGSEGV)).start()
    assert sim_time_us("hc.post", dict(T=64, hc=4, D=1024), cache=cache) is None
    assert "pypto worker died (signal 11)" in next(iter(cache.errors().values()))
    assert sim_time_us("norm.rms", dict(T=16, D=64), cache=cache) > 0
    assert w._proc.pid != pid
    assert not list((w.root / "out").glob(f"output_*_{pid}_*"))  # the dead worker's dir is gone


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(PYPTO_KERNELS))
def test_verify_against_torch_golden(kernel):
    r = verify_kernel(kernel)
    assert r["error"] is None and r["ok"], r


@pytest.mark.slow
@pytest.mark.parametrize("shapes", [dict(T=6, H=1, dim=16, half=8), dict(T=6, H=4, dim=64, half=8, inverse=1)])
def test_verify_rope_variants(shapes):
    r = verify_kernel("rope.apply", shapes=shapes)
    assert r["ok"], r


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["attn.qk_tile", "attn.pv_tile"])
def test_verify_attention_with_merged_token_tasks(kernel):
    # 48 tokens: two per-token cube tasks merged into one (kernels.tokens_per_cube_task), whole K in L1
    r = verify_kernel(kernel, shapes=dict(T=48, H=8, K=128, d=64))
    assert r["error"] is None and r["ok"], r


@pytest.mark.slow
def test_verify_with_natural_shaped_inputs():
    t, hc, d = 6, 4, 128
    x_hc = torch.randn(t, hc, d).bfloat16().float()
    post, comb = torch.rand(t, hc), torch.rand(t, hc, hc)
    sub = torch.randn(t, d).bfloat16()
    r = verify_kernel("hc.post", {"sub": sub, "x_hc": x_hc, "post": post, "comb": comb})
    assert r["ok"] and r["shapes"]["D"] == d, r
    pos = torch.tensor([0, 5, -1, 4095, 7, -3], dtype=torch.int32)
    cos, sin = torch.randn(4096, 8), torch.randn(4096, 8)
    r = verify_kernel("rope.rows", {"cos_table": cos, "sin_table": sin, "pos": pos})
    assert r["ok"] and r["outputs"]["cos"]["exact_frac"] == 1.0, r


@pytest.mark.parametrize("m,k,n,concurrent", [(192, 5120, 512, 1), (192, 2048, 5120, 1), (32, 1280, 8192, 1),
                                               (48, 5120, 2304, 2), (16, 2304, 5120, 48), (48, 256, 32, 1)])
def test_cube_tiles_fit_the_910b_buffers(m, k, n, concurrent):
    """L0A/L0B hold 64 KB, L1 512 KB (A2A3.ini); a tile is never wider than its matrix."""
    kernels = pytest.importorskip("dsv41.kernels.pypto.kernels")
    (tm, _), (k0, k1), (tn, _) = kernels.cube_tiles(m, k, n, concurrent=concurrent)
    assert tm * k0 * 2 <= 64 * 1024 and k0 * tn * 2 <= 64 * 1024
    assert (tm + tn) * k1 * 2 <= 512 * 1024 and k1 % k0 == 0
    assert tn <= -(-n // 16) * 16 and tm <= max(16, -(-m // 16) * 16)
