"""Model cards of the measured models the graph does not size (DeepSeek-V3/R1, V4-Flash) and their
kernel-by-kernel decode step: the weights against the published parameter counts, worked by hand
from the configs, and the step's time accounted for part by part."""
from __future__ import annotations

import pytest

from dsv41.plan import card_step as cs
from dsv41.plan.cards import V3, V4_FLASH
from dsv41.plan.roofline import profile


def test_v3_weights_are_its_config_worked_by_hand():
    """DeepSeek-V3 from its config.json, by hand: per layer MLA q_a + kv_a (7168 x (1536 + 512 + 64)),
    q_b (1536 x 128 x 192), kv_b (512 x 128 x 256), o (128 x 128 x 7168); 3 dense MLPs of 3 x 7168 x
    18432; 58 MoE layers of 257 experts of 3 x 7168 x 2048 and a 256 x 7168 router; embedding and
    head 129280 x 7168 each. The step's kernels hold exactly that, 671.0B against the published 671B,
    and a token uses 36.6B against the published 37B."""
    attn = 7168 * 2112 + 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
    total = 61 * attn + 3 * 3 * 7168 * 18432 + 58 * (257 * 3 * 7168 * 2048 + 256 * 7168) + 2 * 129280 * 7168
    assert sum(cs.weight_params(V3).values()) == total
    assert total == pytest.approx(671e9, rel=0.002)
    active = total - 129280 * 7168 - 58 * 248 * 3 * 7168 * 2048
    assert cs.active_params(V3) == pytest.approx(active)
    assert active == pytest.approx(37e9, rel=0.02)


def test_v4_flash_weights_match_its_published_size():
    """284B total, 13B activated (the model's pages)."""
    assert sum(cs.weight_params(V4_FLASH).values()) == pytest.approx(284e9, rel=0.005)
    assert cs.active_params(V4_FLASH) == pytest.approx(13e9, rel=0.02)


def test_one_token_reads_the_active_weights_once():
    """One request on one card: every dense weight is read, and of the routed experts the expected
    share one token touches (8 of 256): the active parameters plus the head, at FP8 (BF16 for the
    router, the absorbed kv_b and the head)."""
    s = cs.Shape(V3, 1, 1, 1, 1, 1, 1, "all_to_all")
    prec = cs.PRECISION["fp8"]
    read = sum(k.weight_bytes(prec) for k in cs.step_kernels(s))
    p = cs.weight_params(V3)
    expected = (p["linear"] * prec["linear"] + (p["bf16"] - V3.vocab * V3.hidden) * 2
                + p["expert"] * 8 / 256 * prec["expert"])
    assert read == pytest.approx(expected, rel=1e-12)


def test_fp4_expert_formats_differ_only_in_their_scales():
    """MXFP4 stores a value in half a byte plus one E8M0 scale byte per 32 values (0.53125 bytes);
    NVFP4 one E4M3 scale byte per 16 (0.5625 bytes). The rest stays the release's FP8 in both, so an
    EP8 card at batch 1 reads the same non-expert bytes and its experts' bytes in that ratio."""
    assert cs.PRECISION["fp4_experts"]["expert"] == 0.5 + 1 / 32
    assert cs.PRECISION["nvfp4_experts"]["expert"] == 0.5 + 1 / 16
    s = cs.Shape(V3, 8, 1, 8, 1, 1, 1536, "all_reduce")
    experts = next(k for k in cs.layer_kernels(s, 10) if k.what == "experts")
    mx, nv = (experts.weight_bytes(cs.PRECISION[p]) for p in ("fp4_experts", "nvfp4_experts"))
    assert nv / mx == pytest.approx(0.5625 / 0.53125, rel=1e-12)
    attn = [k for k in cs.layer_kernels(s, 10) if "expert" not in k.weights]
    assert [k.weight_bytes(cs.PRECISION["fp4_experts"]) for k in attn] == \
        [k.weight_bytes(cs.PRECISION["nvfp4_experts"]) for k in attn]


def test_an_fp8_latent_cache_reads_half_the_bytes():
    """MLA decode at 1,536 tokens: the latent cache is 1,536 x 576 values a request a layer, two bytes
    each in BF16, one in FP8 (SGLang's --kv-cache-dtype fp8_e4m3); nothing else in the layer changes.
    V4's caches are FP8 already, so a format is refused there."""
    kernels = {kv: cs.layer_kernels(cs.Shape(V3, 8, 1, 8, 32, 1, 1536, "all_reduce", kv=kv), 10)
               for kv in ("bf16", "fp8")}
    mla = {kv: next(k for k in ks if k.what == "MLA decode").other_bytes for kv, ks in kernels.items()}
    assert mla["bf16"] - mla["fp8"] == 32 * 1536 * 576
    rest = {kv: sum(k.other_bytes for k in ks if k.what != "MLA decode") for kv, ks in kernels.items()}
    assert rest["bf16"] == rest["fp8"]
    assert cs.cache_bytes(V3, 1536, "fp8") * 2 == cs.cache_bytes(V3, 1536)
    with pytest.raises(ValueError, match="kv in"):
        cs.plan_card(V4_FLASH, 8, 1, 8, 1, 1024, profile("b200"), scheme="all_reduce", kv="fp8")


def test_tensor_parallel_experts_split_each_expert():
    """SGLang at TP8 with --ep-size 1: each card holds an eighth of every expert, no all-to-all, and
    the MoE output is one all-reduce over the eight cards."""
    s = cs.Shape(V3, 8, 1, 1, 8, 1, 1536, "all_reduce")
    experts = next(k for k in cs.layer_kernels(s, 10) if k.what == "experts")
    assert experts.weights["expert"] == 256 * 3 * 7168 * 2048 / 8 and not experts.handoff
    combine = next(k for k in cs.layer_kernels(s, 10) if k.what == "combine")
    assert combine.handoff[0] == "all_reduce" and combine.handoff[2] == 8


@pytest.mark.parametrize("dispatch", ["graph", "eager"])
def test_the_step_is_its_parts(dispatch):
    dev = profile("h100")
    r = cs.plan_card(V3, 1, 16, 16, 64, 4096, dev, draft=1, dispatch=dispatch)
    assert sum(r["breakdown_us"].values()) == pytest.approx(r["predicted_step_us"], rel=1e-12)
    assert r["breakdown_us"]["collectives"] > 0 and r["layers"] == 61
    plain = cs.plan_card(V3, 1, 16, 16, 64, 4096, dev, dispatch=dispatch)
    assert r["predicted_step_us"] > plain["predicted_step_us"]      # the MTP draft pass and the verified rows


def test_a_bad_layout_is_refused():
    with pytest.raises(ValueError, match="needs ep = tp x dp"):
        cs.plan_card(V3, 2, 4, 4, 1, 1024, profile("h100"))
    with pytest.raises(ValueError, match="precision in"):
        cs.plan_card(V3, 1, 1, 1, 1, 1024, profile("h100"), precision="fp16")


def test_dispatch_message_bytes_by_format():
    """One dispatched token of DeepSeek-V3 (hidden 7168): DeepEP's FP8 low-latency message is a 16-byte
    header, 7168 FP8 values and 7168 / 128 = 56 FP32 scales = 7408 bytes, against 2 x 7168 + 8 = 14344
    in BF16; INT8 with one FP32 scale 7168 + 4 + 8 = 7180. The combine is BF16 in every format."""
    assert cs.A2A_FORMATS["fp8"](7168) == 16 + 7168 + 56 * 4 == 7408
    assert cs.A2A_FORMATS["bf16"](7168) == 14344 and cs.A2A_FORMATS["int8"](7168) == 7180
    # EP16, 64 requests a rank: 16 x 64 x 8 / 16 = 512 (token, expert) pairs a rank, 15 / 16 of them remote
    kernels = {a2a: {k.what: k for k in cs.layer_kernels(cs.Shape(V3, 1, 16, 16, 64, 1, 4096, "all_to_all", a2a), 10)}
               for a2a in ("bf16", "fp8")}
    assert kernels["fp8"]["experts"].handoff == ("a2a", 512 * 15 / 16 * 7408)
    assert kernels["bf16"]["experts"].handoff == ("a2a", 512 * 15 / 16 * 14344)
    assert kernels["fp8"]["combine"].handoff == kernels["bf16"]["combine"].handoff == ("a2a", 64 * 8 * 15 / 16 * 14340)


def test_two_micro_batch_layer_hand_worked():
    """One micro-batch's kernels priced by hand (launch, sync, bytes, body): ATTN-0 10 µs, ATTN-1 30,
    the shared expert 5, the experts 15 on the compute lane with their dispatch 5 + 35 = 40 on the wire,
    the combine 5 with 4 + 21 = 25 on the wire. Each micro-batch adds MLP 15 + 5, then max(SHARED +
    ATTN-0 = 15, dispatch 40) = 40 (the wire is the critical path), then max(ATTN-1 30, combine 25) = 30
    (the compute is): 90, and the layer runs two: 180 µs."""
    ks = [cs.Kernel("a0", "vector", 1, stage="a0"), cs.Kernel("a1", "vector", 1),
          cs.Kernel("experts", "matmul", 4, handoff=("a2a", 1.0), stage="mlp"),
          cs.Kernel("shared", "matmul", 5, stage="shared"),
          cs.Kernel("combine", "vector", 2, handoff=("a2a", 1.0), stage="mlp")]
    priced = {"a0": (1, 0, 0, 9, "memory"), "a1": (2, 0, 0, 28, "compute"), "experts": (2, 5, 35, 13, "memory"),
              "shared": (1, 0, 0, 4, "memory"), "combine": (1, 4, 21, 4, "memory")}
    path = cs.tbo_layer(ks, lambda k: priced[k.what])
    assert cs._span(path) == 180
    assert sum(p[1] for p in path) == 2 * 5 and sum(p[2] for p in path) == 2 * 35     # the dispatch's wire, not the combine's
    assert sum(p[3] for p in path if p[4] == "compute") == 2 * 28                     # ATTN-1 on the path
    quiet = {**priced, "experts": (2, 1, 4, 13, "memory")}        # dispatch 5 < SHARED + ATTN-0 15: hidden
    assert cs._span(cs.tbo_layer(ks, lambda k: quiet[k.what])) == 2 * (20 + 15 + 30)


def test_overlap_hides_a_large_all_to_all_and_costs_where_there_is_none():
    """DeepSeek's service layout (EP144 over 18 nodes, 88 requests a GPU): two micro-batches hide most of
    the all-to-all, so the step falls; on one card (nothing to hide) the split only reads the weights
    twice and launches twice the kernels, so the step rises. Either way the step is its parts."""
    dev = profile("h100")
    serial = cs.plan_card(V3, 1, 144, 144, 88, 4989, dev, a2a="fp8")
    tbo = cs.plan_card(V3, 1, 144, 144, 88, 4989, dev, a2a="fp8", overlap="tbo")
    assert tbo["predicted_step_us"] < serial["predicted_step_us"]
    assert tbo["breakdown_us"]["collectives"] < serial["breakdown_us"]["collectives"]
    assert sum(tbo["breakdown_us"].values()) == pytest.approx(tbo["predicted_step_us"], rel=1e-12)
    assert tbo["kernels"] == serial["kernels"] + 58 * len(cs.layer_kernels(cs.Shape(V3, 1, 144, 144, 44, 1, 4989,
                                                                                      "all_to_all"), 10))
    alone = cs.plan_card(V3, 1, 1, 1, 2, 1024, dev)
    assert cs.plan_card(V3, 1, 1, 1, 2, 1024, dev, overlap="tbo")["predicted_step_us"] > alone["predicted_step_us"]


def test_stated_experts_per_rank():
    """DeepSeek's decode: 2 routed experts a GPU (256 + 32 redundant over 144), not 256 / 144."""
    s = cs.Shape(V3, 1, 144, 144, 88, 1, 4989, "all_to_all", "fp8", 2)
    experts = next(k for k in cs.layer_kernels(s, 10) if k.what == "experts")
    assert experts.weights["expert"] == 2 * 3 * 7168 * 2048
    with pytest.raises(ValueError, match="experts_per_rank"):
        cs.plan_card(V3, 1, 144, 144, 88, 4989, profile("h100"), experts_per_rank=1.5)


def test_overlap_needs_an_all_to_all_step_to_split():
    with pytest.raises(ValueError, match="overlap 'tbo'"):
        cs.plan_card(V3, 8, 1, 8, 8, 1024, profile("h200"), scheme="all_reduce", overlap="tbo")
    with pytest.raises(ValueError, match="overlap in"):
        cs.plan_card(V3, 1, 16, 16, 8, 1024, profile("h100"), overlap="dbo")
