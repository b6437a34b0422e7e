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
