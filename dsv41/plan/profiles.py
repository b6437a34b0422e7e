"""Device profiles for the roofline model: public peak figures, each with where it comes from.

Rates are dense (no sparsity). ``mx`` is the FP8/MXFP8 matmul rate: the FP4 experts are decoded to
FP8 tiles and run on the MXFP8 path (spec 03 §4.1), so they count at the FP8 rate too. Figures a
vendor has not published are marked as assumptions and chosen to be conservative.
"""
from __future__ import annotations

from dataclasses import dataclass

T, P, G = 1e12, 1e15, 1e9


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    flops_per_s: dict          # "mx" (FP8), "dense" (BF16 matmul), "vector" (FP32 SIMD)
    link_bytes_per_s: float    # per card, one direction: what a card can receive
    sources: tuple[str, ...]
    assumptions: tuple[str, ...] = ()


_HUAWEI_CONNECT_2025 = (
    "Huawei Connect 2025 (18 Sep 2025) Ascend roadmap: Ascend 950 FP8 1 PFLOPS, MXFP4 2 PFLOPS, "
    "interconnect 2 TB/s; 950PR HiBL 1.0 128 GB at 1.6 TB/s; 950DT HiZQ 2.0 144 GB at 4 TB/s. As reported by "
    "https://www.medcom.id/teknologi/news-teknologi/akW27ydb-huawei-punya-hbm-buatan-sendiri-targetkan-supercluster-raksasa "
    "and https://reportify.ai/social-media/721107923617455 (whose table swaps the PR/DT memory rows)",
)
_A5_ASSUMED = (
    "BF16 matmul rate not published: taken as half the FP8 rate",
    "FP32 vector rate not published: taken as 64 TFLOPS (an H200 has 67)",
    "the 2 TB/s interconnect figure is used as one direction's bandwidth",
)
_A5_RATES = {"mx": 1 * P, "dense": 0.5 * P, "vector": 64 * T}

PROFILES = {
    "a5": DeviceProfile(
        "a5", "Ascend 950DT (A5-class, decode/training part)", 144 * G, 4.0 * T, _A5_RATES, 2.0 * T,
        _HUAWEI_CONNECT_2025, _A5_ASSUMED),
    "a5-pr": DeviceProfile(
        "a5-pr", "Ascend 950PR (A5-class, prefill part)", 128 * G, 1.6 * T, _A5_RATES, 2.0 * T,
        _HUAWEI_CONNECT_2025, _A5_ASSUMED),
    "h200": DeviceProfile(
        "h200", "NVIDIA H200 SXM", 141 * G, 4.8 * T, {"mx": 1979 * T, "dense": 989 * T, "vector": 67 * T},
        450 * G,
        ("NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ : 141 GB HBM3e "
         "at 4.8 TB/s; FP8 3,958 / BF16 1,979 TFLOPS with sparsity (half that dense); FP32 67 TFLOPS; "
         "NVLink 900 GB/s (both directions together)",)),
}
