"""Device profiles: peak figures for the roofline and what a deployment achieves of them, each cited.

Rates are dense (no sparsity). ``mx`` is the rate the FP8/FP4-weight matmuls run at: the FP8 tensor
rate where a part has one; on Ascend 910B/910C, which have no FP8 units, the INT8 rate, because
deployments there serve DeepSeek models as W8A8 INT8 (vLLM-Ascend and SGLang-Ascend ship
``DeepSeek-V4-Flash-w8a8`` checkpoints). ``dense`` is the BF16 matmul rate, ``vector`` FP32 SIMD.

A ``card`` of the plan is one device the runtime addresses: a GPU, or one die of an Ascend 910C
(the runtimes address the two dies of a 910C as two devices: SGLang-Ascend sets ``--tp-size`` to
twice the card count). ``sources`` names where every constant comes from; an entry that starts
with ``assumption:`` says why that value where no public figure was found. No constant is taken from
an end-to-end step time or throughput of a DeepSeek model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

T, P, G = 1e12, 1e15, 1e9
CONSTANTS = ("hbm_bytes", "hbm_bytes_per_s", "flops_per_s", "efficiency", "intra", "inter", "cards_per_node",
             "launch_us", "host_launch_us", "graph_launch_us", "host_step_us")


@dataclass(frozen=True)
class Link:
    """One class of link as a card sees it: peak bytes per second one direction, the fraction a
    collective achieves, the latency of one step (hop), and how a TP collective runs on it:
    ``ring`` (p-1 steps to one neighbour, switched fabrics) or ``mesh`` (every peer at once over
    point-to-point links, one step)."""
    bytes_per_s: float
    efficiency: float
    hop_us: float
    algorithm: str = "ring"

    @property
    def achievable(self) -> float:
        return self.bytes_per_s * self.efficiency


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    flops_per_s: dict          # "mx", "dense", "vector"
    efficiency: dict           # kernel class -> (fraction of HBM bandwidth, fraction of the FLOP rates)
    intra: Link                # between cards of one node (or supernode)
    inter: Link                # between nodes
    cards_per_node: int
    launch_us: float           # device-side gap per kernel
    host_launch_us: float      # host time to issue one kernel, eager launch
    graph_launch_us: float     # host time to replay one captured step graph
    host_step_us: float        # host work per step the device waits for (scheduling, sampling sync)
    sources: dict = field(default_factory=dict)   # constant -> where it comes from

    @property
    def link_bytes_per_s(self) -> float:
        """The roofline's link: a card's peak intra-node bandwidth, one direction."""
        return self.intra.bytes_per_s


# ---- shared sources ----------------------------------------------------------------------------

_DEEPGEMM = ("DeepGEMM README (github.com/deepseek-ai/DeepGEMM): FP8 GEMM up to 1550 TFLOPS on H800 "
             "(dense FP8 peak 1979) -> 0.78 of peak")
_FLASHMLA = ("FlashMLA README (github.com/deepseek-ai/FlashMLA): dense MLA decoding up to 3000 GB/s memory-bound on "
             "H800 SXM5 (3.35 TB/s) -> 0.90; sparse FP8 decoding 410 TFLOPS compute-bound (BF16 peak 989) -> 0.41")
_GATHER_BW = ("assumption: sparse attention and table lookups read rows of 0.5-1 KB at data-dependent addresses; "
              "taken as 0.6 of HBM bandwidth (no public microbenchmark of row-gather bandwidth found)")
_VECTOR_RATE = "assumption: elementwise kernels are memory-bound here; half the vector rate is taken as achievable"
_EFFICIENCY = {"matmul": (0.90, 0.78), "gather": (0.60, 0.41), "vector": (0.90, 0.50)}
_EFFICIENCY_SRC = f"matmul: bandwidth {_FLASHMLA}; rate {_DEEPGEMM}. gather: bandwidth {_GATHER_BW}; rate " \
                  f"FlashMLA sparse decoding (above). vector: bandwidth as matmul; rate {_VECTOR_RATE}"
_EFFICIENCY_ASCEND = _EFFICIENCY_SRC + ("; assumption for Ascend: the Hopper kernel fractions are reused "
                                        "(no public per-kernel microbenchmark found)")
_CUDA_GRAPHS = ("assumption: 2 us device gap per kernel, the order of the per-kernel launch overhead NVIDIA's "
                "'Getting Started with CUDA Graphs' blog (developer.nvidia.com/blog/cuda-graphs) measures for short "
                "kernels (a few us eager, less with a graph); the same for Ascend task launch (not published)")
_HOST_LAUNCH = ("assumption: 5 us of host time per eager launch from a Python serving loop (framework dispatch + "
                "driver call); only used with --dispatch eager")
_GRAPH_LAUNCH = "assumption: 20 us to replay one captured decode graph (one host call per step)"
_HOST_STEP = ("assumption: 100 us per step: with an overlap scheduler (SGLang v0.4 'zero-overhead batch scheduler', "
              "lmsys.org/blog/2024-12-04-sglang-v0-4; TensorRT-LLM overlap scheduler docs) step n+1 is scheduled "
              "while step n runs, leaving the sampled-token sync and input copy")
_NVLINK4 = "NVLink 4: 900 GB/s per GPU both directions together (NVIDIA H100/H200/H20 datasheets) -> 450 GB/s one way"
_NVLINK_EFF = ("DeepEP README (github.com/deepseek-ai/DeepEP, legacy V1 table): intranode EP8 dispatch/combine reach "
               "153/158 GB/s on H800 NVLink (200 GB/s one way) -> 0.77")
_NVLINK_HOP = ("assumption: 3 us per ring step (NCCL LL-protocol small-message latency on NVSwitch is a few us; "
               "no single published per-hop figure)")
_CX7 = ("one ConnectX-7 400 Gb/s NIC per GPU (HGX reference design) = 50 GB/s; DeepEP legacy table: 46 GB/s of "
        "~50 GB/s achieved by its low-latency RDMA kernels on H800 + CX7 -> 0.9")
_IB_HOP = "assumption: 5 us per step across InfiniBand (RDMA write + completion through one switch)"

_HOPPER = {
    "efficiency": _EFFICIENCY_SRC, "inter": f"{_CX7}; hop: {_IB_HOP}", "cards_per_node": "8 GPUs per HGX board (NVIDIA HGX H100/H200 reference design)",
    "intra": f"{_NVLINK4}; efficiency: {_NVLINK_EFF}; hop: {_NVLINK_HOP}"}
_NVLINK = Link(450 * G, 0.77, 3.0)
_IB = Link(50 * G, 0.9, 5.0)

_CLOUDMATRIX = ("Zuo et al., 'Serving Large Language Models on Huawei CloudMatrix384' (arXiv 2506.12708): Ascend 910C "
                "= two dies, 752 TFLOPS BF16 and 128 GB HBM at 3.2 TB/s per package (so per die 376 TFLOPS, 64 GB, "
                "1.6 TB/s), INT8 at twice the BF16 rate; UB plane 392 GB/s one way per 910C (196 GB/s per die), "
                "non-blocking across the 384-NPU supernode")
_SGL_NPU = ("sgl-kernel-npu README (DeepEP-style dispatch/combine on Ascend A3): intranode EP8 102/152 GB/s, "
            "internode EP16 87/121 GB/s, of 196 GB/s per die -> 0.6")
_UB_HOP = ("assumption: 2 us per step; the CloudMatrix384 descriptions give sub-microsecond switch latency, "
           "to which a collective step adds a synchronisation")
_A2 = ("assumption: an Ascend 910B is taken as one 910C die (same generation; CloudMatrix384 paper above): "
       "376 TFLOPS BF16, INT8 twice that, 64 GB at 1.6 TB/s. Public 910B figures disagree (256-376 TFLOPS FP16)")
_HCCS = ("assumption: Atlas 800 A2 full mesh of HCCS links, 7 peers x 56 GB/s = 392 GB/s one way (commonly reported "
         "figure, no datasheet found); mesh collectives; efficiency 0.6 as the Ascend dispatch benchmark above "
         f"({_SGL_NPU}); hop 3 us assumed like NVLink")
_ROCE_A2 = "assumption: one 200 Gb/s RoCE port per NPU (25 GB/s), 0.9 achieved and 5 us per step as InfiniBand"
_VEC_ASCEND = ("assumption: FP32 vector rate not published; taken as 1/16 of the BF16 cube rate "
               "(the vector units are a small part of a Da Vinci core)")

_HUAWEI_CONNECT_2025 = (
    "Huawei Connect 2025 (18 Sep 2025) Ascend roadmap: Ascend 950 FP8 1 PFLOPS, MXFP4 2 PFLOPS, "
    "interconnect 2 TB/s; 950PR HiBL 1.0 128 GB at 1.6 TB/s; 950DT HiZQ 2.0 144 GB at 4 TB/s. As reported by "
    "https://www.medcom.id/teknologi/news-teknologi/akW27ydb-huawei-punya-hbm-buatan-sendiri-targetkan-supercluster-raksasa "
    "and https://reportify.ai/social-media/721107923617455 (whose table swaps the PR/DT memory rows)")
_A5_RATES = {"mx": 1 * P, "dense": 0.5 * P, "vector": 64 * T}
_A5 = {
    "flops_per_s": ("FP8 1 PFLOPS: " + _HUAWEI_CONNECT_2025 + "; assumption: BF16 matmul rate not published, taken as "
                    "half the FP8 rate; FP32 vector rate not published, taken as 64 TFLOPS (an H200 has 67)"),
    "efficiency": _EFFICIENCY_ASCEND,
    "intra": ("2 TB/s interconnect per chip (Huawei Connect 2025, above), taken as one direction; efficiency 0.6 "
              f"as Ascend A3 ({_SGL_NPU}); hop: {_UB_HOP}"),
    "inter": "assumption: the Atlas 950 SuperPoD extends the same UB fabric across nodes, so inter = intra",
    "cards_per_node": "assumption: 8 per node, like the A2/A3 servers"}
_UB_A5 = Link(2.0 * T, 0.6, 2.0)


def _profile(name, description, hbm, bw, rates, intra, inter, per_node, sources) -> DeviceProfile:
    """Launch and host costs are the same assumptions on every device, cited here once."""
    return DeviceProfile(name, description, hbm, bw, rates, _EFFICIENCY, intra, inter, per_node,
                         launch_us=2.0, host_launch_us=5.0, graph_launch_us=20.0, host_step_us=100.0,
                         sources={**sources, "launch_us": _CUDA_GRAPHS, "host_launch_us": _HOST_LAUNCH,
                                  "graph_launch_us": _GRAPH_LAUNCH, "host_step_us": _HOST_STEP})


PROFILES = {p.name: p for p in (
    _profile("a2", "Ascend 910B (Atlas 800 A2, 8 per node)", 64 * G, 1.6 * T,
             {"mx": 752 * T, "dense": 376 * T, "vector": 23.5 * T},
             Link(392 * G, 0.6, 3.0, "mesh"), Link(25 * G, 0.9, 5.0), 8,
             {"hbm_bytes": _A2, "hbm_bytes_per_s": _A2, "flops_per_s": f"{_A2}; vector: {_VEC_ASCEND}",
              "efficiency": _EFFICIENCY_ASCEND, "intra": _HCCS, "inter": _ROCE_A2,
              "cards_per_node": "Atlas 800 A2: 8 NPUs (vLLM-Ascend DeepSeek-V4-Flash tutorial: 'Atlas 800 A2 (64G x 8)')"}),
    _profile("a3", "Ascend 910C die (Atlas 800 A3 / CloudMatrix384: 8 cards, 16 dies per node)", 64 * G, 1.6 * T,
             {"mx": 752 * T, "dense": 376 * T, "vector": 23.5 * T},
             Link(196 * G, 0.6, 2.0), Link(196 * G, 0.6, 2.0), 16,
             {"hbm_bytes": _CLOUDMATRIX, "hbm_bytes_per_s": _CLOUDMATRIX,
              "flops_per_s": f"{_CLOUDMATRIX}; vector: {_VEC_ASCEND}", "efficiency": _EFFICIENCY_ASCEND,
              "intra": f"{_CLOUDMATRIX}; efficiency: {_SGL_NPU}; hop: {_UB_HOP}",
              "inter": "the UB plane spans the supernode (paper above), so inter-node = intra-node",
              "cards_per_node": "8 Ascend 910C per node (paper above), two dies each"}),
    _profile("a5", "Ascend 950DT (A5-class, decode/training part)", 144 * G, 4.0 * T, _A5_RATES, _UB_A5, _UB_A5, 8,
             {"hbm_bytes": _HUAWEI_CONNECT_2025, "hbm_bytes_per_s": _HUAWEI_CONNECT_2025, **_A5}),
    _profile("a5-pr", "Ascend 950PR (A5-class, prefill part)", 128 * G, 1.6 * T, _A5_RATES, _UB_A5, _UB_A5, 8,
             {"hbm_bytes": _HUAWEI_CONNECT_2025, "hbm_bytes_per_s": _HUAWEI_CONNECT_2025, **_A5}),
    _profile("h200", "NVIDIA H200 SXM (HGX, 8 per node)", 141 * G, 4.8 * T,
             {"mx": 1979 * T, "dense": 989 * T, "vector": 67 * T}, _NVLINK, _IB, 8,
             {"hbm_bytes": "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e at 4.8 TB/s",
              "hbm_bytes_per_s": "NVIDIA H200 datasheet (above)",
              "flops_per_s": "NVIDIA H200 datasheet: FP8 3,958 / BF16 1,979 TFLOPS with sparsity (half dense); FP32 67",
              **_HOPPER}),
    _profile("h100", "NVIDIA H100 SXM (HGX, 8 per node)", 80 * G, 3.35 * T,
             {"mx": 1979 * T, "dense": 989 * T, "vector": 67 * T}, _NVLINK, _IB, 8,
             {"hbm_bytes": "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): 80 GB HBM3 at 3.35 TB/s",
              "hbm_bytes_per_s": "NVIDIA H100 datasheet (above)",
              "flops_per_s": "NVIDIA H100 SXM datasheet: FP8 3,958 / BF16 1,979 TFLOPS with sparsity (half dense); "
                             "FP32 67", **_HOPPER}),
    _profile("b200", "NVIDIA B200 (HGX, 8 per node)", 180 * G, 8.0 * T,
             {"mx": 4500 * T, "dense": 2250 * T, "vector": 75 * T}, Link(900 * G, 0.77, 3.0), _IB, 8,
             {"hbm_bytes": "NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 1,440 GB HBM3e and "
                           "64 TB/s over 8 GPUs -> 180 GB at 8 TB/s per GPU",
              "hbm_bytes_per_s": "NVIDIA DGX B200 datasheet (above)",
              "flops_per_s": "NVIDIA DGX B200 datasheet: FP8 72 PFLOPS training over 8 GPUs -> 9 PFLOPS with "
                             "sparsity, 4.5 dense per GPU; BF16 half that; assumption: FP32 vector 75 TFLOPS "
                             "(not in the datasheet; the Hopper figure scaled by the SM count ratio)",
              **_HOPPER, "efficiency": _EFFICIENCY_SRC + "; assumption: the Hopper fractions hold on Blackwell",
              "intra": "NVLink 5: 1.8 TB/s per GPU both directions (DGX B200 datasheet) -> 900 GB/s one way; "
                       "DeepEP V2 README: EP8 NVLink dispatch/combine 726/740 GB/s on SM100 -> 0.8, 0.77 kept as "
                       f"Hopper; hop: {_NVLINK_HOP}"}),
    _profile("h20", "NVIDIA H20 (HGX, 8 per node)", 96 * G, 4.0 * T,
             {"mx": 296 * T, "dense": 148 * T, "vector": 44 * T}, _NVLINK, _IB, 8,
             {"hbm_bytes": "NVIDIA H20 product brief as reported by willitrunai.com/gpus/h20-96gb and "
                           "unanswered.io/guide/nvidia-h20-hbm-memory: 96 GB HBM3 at 4.0 TB/s",
              "hbm_bytes_per_s": "NVIDIA H20 product brief as reported above: 4.0 TB/s",
              "flops_per_s": "NVIDIA H20 product brief (as reported above): FP8 296, BF16 148 TFLOPS dense; FP32 44",
              **_HOPPER, "inter": f"assumption: the HGX H20 board carries the same NIC per GPU as HGX H100; {_CX7}"}),
)}
