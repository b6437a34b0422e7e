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

from dataclasses import dataclass, field, replace

from dsv41.plan.primitives import AlphaBeta, ByRanks, Point, fit

T, P, G = 1e12, 1e15, 1e9
MIB = 1 << 20
CONSTANTS = ("hbm_bytes", "hbm_bytes_per_s", "flops_per_s", "efficiency", "intra", "inter", "cards_per_node",
             "launch_us", "host_launch_us", "graph_launch_us", "host_step_us", "token_sync_us")


@dataclass(frozen=True)
class Link:
    """One class of link as a card sees it: peak bytes per second one direction (the roofline's
    link) and the fraction a transfer achieves, then the two primitives fit to microbenchmarks on
    it: one TP collective call (``collective``) and one MoE dispatch or combine call by the number
    of EP ranks taking part (``a2a``)."""
    bytes_per_s: float
    efficiency: float
    collective: AlphaBeta
    a2a: ByRanks

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
    host_step_us: float        # host work per step before the first kernel (scheduling, input copy)
    token_sync_us: float       # the sampled tokens' copy to the host and its wait, at the end of a step
    sources: dict = field(default_factory=dict)   # constant -> where it comes from
    # checkpoint format -> ns per weight value on each use, before the body: a part whose kernels
    # read the stored formats (every accelerator profile) has none; this CPU decodes each value to FP32 per use
    weight_use_ns: dict = field(default_factory=dict)
    shared_cores: int = 0      # the cards are threads or processes sharing this many host cores (0: own devices)
    # node kind -> operators.Operator: measured latencies by shape and the fit between them; a kind
    # without one is priced by the roofline above
    operators: dict = field(default_factory=dict)

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
_GAP_ASCEND = ("assumption: 2 us device gap per kernel (no public figure for a kernel's gap in a captured graph on "
               "Ascend; the order of NVIDIA's per-kernel overhead, 'Getting Started with CUDA Graphs', "
               "developer.nvidia.com/blog/cuda-graphs)")
_GAP_CUDA_GRAPH = ("1.3 us device gap per kernel: Hazy Research, 'Look Ma, No Bubbles! Designing a Low-Latency "
                   "Megakernel for Llama-1B' (hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles, 2025-05-27): "
                   "on an H100, even with CUDA graphs, each kernel's launch and teardown costs about 1.3 us in "
                   "which the GPU does no useful work (figure as summarised at "
                   "mlops.substack.com/p/one-megakernel-to-rule-llama-1b). The serving stacks the plan is checked "
                   "against replay a captured graph per decode step: SGLang enables CUDA graphs for decode by "
                   "default (SGLang docs, 'CUDA Graph for Decode'), vLLM captures them unless --enforce-eager. "
                   "With --dispatch eager the host's issue per kernel (host_launch_us) bounds the step as well. "
                   "assumption: the same on Blackwell and H20 (no per-part figure found)")
_HOST_LAUNCH = ("assumption: 5 us of host time per eager launch from a Python serving loop (framework dispatch + "
                "driver call); only used with --dispatch eager")
_GRAPH_LAUNCH = "assumption: 20 us to replay one captured decode graph (one host call per step)"
_HOST_STEP = ("assumption: 100 us per step: with an overlap scheduler (SGLang v0.4 'zero-overhead batch scheduler', "
              "lmsys.org/blog/2024-12-04-sglang-v0-4; TensorRT-LLM overlap scheduler docs) step n+1 is scheduled "
              "while step n runs, leaving the input copy and the metadata update before its first kernel")
_TOKEN_SYNC = ("assumption: 20 us at the end of every step for the sampled tokens: a device-to-host copy of a few "
               "bytes and the host's wait on it, which the next step's inputs depend on (the order of one small "
               "cudaMemcpy plus an event synchronisation; no public microbenchmark of this pair found)")
_NVLINK4 = "NVLink 4: 900 GB/s per GPU both directions together (NVIDIA H100/H200/H20 datasheets) -> 450 GB/s one way"
_NVLINK_EFF = ("DeepEP README (github.com/deepseek-ai/DeepEP, legacy V1 table): intranode EP8 dispatch/combine reach "
               "153/158 GB/s on H800 NVLink (200 GB/s one way) -> 0.77")
_NCCL_NVSWITCH = ("nccl-tests alltoall_perf on one 8x H20 HGX node (NVLink 4 through NVSwitch), as posted in "
                  "github.com/deepseek-ai/DeepEP/issues/303: 128 B 10.59 us, 1 KB 10.80 us, 4 KB 11.13 us; with a "
                  "64 MiB point at the link's achievable bandwidth (above) the fit gives the small-message floor "
                  "(alpha) and the bandwidth (beta). assumption: an all-gather or reduce-scatter call over the "
                  "TP group has the same floor as this all-to-all on the same fabric (NCCL's LL protocol sets both)")
_NVSWITCH_POINTS = (Point(128, 10.59), Point(1024, 10.80), Point(4096, 11.13))
_DEEPEP_LL = ("DeepEP V1 low-latency kernels on H800 + CX7 400 Gb/s (github.com/deepseek-ai/DeepEP docs/legacy.md, "
              "'Low-latency kernels with pure RDMA' table; 128 tokens per batch, 7168 hidden, top-8, FP8 dispatch, "
              "BF16 combine): dispatch/combine per call 77/114 us at EP8, 118/195 at EP16, 155/273 at EP32, 173/314 "
              "at EP64, 192/369 at EP128, 194/360 at EP256, with the bandwidth column giving each call's bytes "
              "(time x bandwidth); per EP size, the dispatch and the combine point (about 2x the bytes) fit alpha "
              "and beta")
# EP -> (dispatch us, GB/s), (combine us, GB/s)
_DEEPEP_LL_TABLE = {8: ((77, 98), (114, 127)), 16: ((118, 63), (195, 74)), 32: ((155, 48), (273, 53)),
                    64: ((173, 43), (314, 46)), 128: ((192, 39), (369, 39)), 256: ((194, 39), (360, 40))}
_DEEPEP_LL_NVL = ("DeepEP low-latency kernels with NVLink for the peers inside a node "
                  "(github.com/deepseek-ai/DeepEP/pull/173, 'Feature: LL nvlink p2p', merged 2025-05-22; 8x H20 in "
                  "one node, NVLink 4 through NVSwitch, DeepEP's low-latency test: 128 tokens, 7168 hidden, top-8, "
                  "FP8 dispatch, BF16 combine): EP8 dispatch 37 us at 203.2 GB/s, combine 59 us at 244.2 GB/s (172 "
                  "and 319 us over RDMA on the same node); bytes = time x bandwidth, the two points fit alpha 13.0 "
                  "us, beta 313 GB/s. NVLink is DeepEP's default for intranode peers of its low-latency kernels "
                  "since (allow_nvlink_for_low_latency_mode, deepseek-ai/DeepEP#189; vllm-project/vllm#27677). An "
                  "EP group inside one NVLink domain (8 GPUs on an HGX H100/H200/H20/B200 board's NVSwitch) uses "
                  "this; one with a peer on another node the RDMA table (same PR at EP16 across two H20 nodes: "
                  "119/199 us, as the RDMA table's 118/195)")
# EP -> (dispatch us, GB/s), (combine us, GB/s)
_DEEPEP_LL_NVL_TABLE = {8: ((37, 203.2), (59, 244.2))}
_NCCL_IB = ("NCCL's own latency model for a small all-reduce across H100 nodes (its tuner's predicted time, printed "
            "in github.com/NVIDIA/nccl/issues/1453): 4 KB 25.87 us, 8 KB 26.55 us; with a 64 MiB point at the "
            "link's achievable bandwidth")
_IB_POINTS = (Point(4096, 25.87), Point(8192, 26.55))
_CX7 = ("one ConnectX-7 400 Gb/s NIC per GPU (HGX reference design) = 50 GB/s; DeepEP legacy table: 46 GB/s of "
        "~50 GB/s achieved by its low-latency RDMA kernels on H800 + CX7 -> 0.9")


def _per_call(table: dict) -> tuple:
    """EP -> the (bytes, us) points of one dispatch and one combine call, from time and bandwidth."""
    return tuple((ep, tuple(Point(us * gbps * 1e3, us) for us, gbps in calls)) for ep, calls in sorted(table.items()))


def _link(peak: float, efficiency: float, small_points: tuple, a2a_table: dict) -> Link:
    """A link whose two primitives are fit to the cited points; the achievable bandwidth supplies the
    large-message point of the collective and the fallback slope (see ``primitives.fit``)."""
    achievable = peak * efficiency
    big = Point(64 * MIB, 64 * MIB / achievable * 1e6)
    a2a = ByRanks(tuple((ep, fit(pts, achievable)) for ep, pts in _per_call(a2a_table)))
    return Link(peak, efficiency, fit(small_points + (big,), achievable), a2a)


def _borrowed(link: Link, peak: float, efficiency: float) -> Link:
    """Another part's fitted alphas (where this part has no table of its own), the bytes crossing at
    this link's achievable bandwidth."""
    beta = peak * efficiency
    return Link(peak, efficiency, AlphaBeta(link.collective.alpha_us, beta),
                ByRanks(tuple((ep, AlphaBeta(ab.alpha_us, beta)) for ep, ab in link.a2a.fits)))


_HOPPER = {
    "efficiency": _EFFICIENCY_SRC, "cards_per_node": "8 GPUs per HGX board (NVIDIA HGX H100/H200 reference design)",
    "inter": f"{_CX7}; collective: {_NCCL_IB}; dispatch/combine: {_DEEPEP_LL}",
    "intra": f"{_NVLINK4}; efficiency: {_NVLINK_EFF}; collective: {_NCCL_NVSWITCH}; dispatch/combine: "
             f"{_DEEPEP_LL_NVL}"}
_NVLINK = _link(450 * G, 0.77, _NVSWITCH_POINTS, _DEEPEP_LL_NVL_TABLE)
_IB = _link(50 * G, 0.9, _IB_POINTS, _DEEPEP_LL_TABLE)

_CLOUDMATRIX = ("Zuo et al., 'Serving Large Language Models on Huawei CloudMatrix384' (arXiv 2506.12708): Ascend 910C "
                "= two dies, 752 TFLOPS BF16 and 128 GB HBM at 3.2 TB/s per package (so per die 376 TFLOPS, 64 GB, "
                "1.6 TB/s), INT8 at twice the BF16 rate; UB plane 392 GB/s one way per 910C (196 GB/s per die), "
                "non-blocking across the 384-NPU supernode")
_SGL_NPU = ("sgl-kernel-npu README (DeepEP-style dispatch/combine on Ascend A3): intranode EP8 102/152 GB/s, "
            "internode EP16 87/121 GB/s, of 196 GB/s per die -> 0.6")
_SGL_NPU_LL = ("sgl-kernel-npu README (github.com/sgl-project/sgl-kernel-npu), 'Low-Latency Kernels with Pure HCCS' "
               "on an A3 384 SuperPOD (128 tokens per batch, 7168 hidden, top-8, INT8 dispatch, BF16 combine): "
               "dispatch/combine per call 132/126 us at EP8, 139/135 at EP16, 153/151 at EP32, bytes = time x the "
               "bandwidth column; the combine moves twice the bytes in less time (dispatch also quantises), so the "
               "slope is not pinned and the link's achievable bandwidth is taken as beta, alpha fit")
_SGL_NPU_LL_TABLE = {8: ((132, 58), (126, 116)), 16: ((139, 55), (135, 109)), 32: ((153, 49), (151, 97))}
_HCCL_FLOOR = ("assumption: no public HCCL small-message table found; the collective's floor is taken from "
               f"NVSwitch ({_NCCL_NVSWITCH})")
_A2 = ("assumption: an Ascend 910B is taken as one 910C die (same generation; CloudMatrix384 paper above): "
       "376 TFLOPS BF16, INT8 twice that, 64 GB at 1.6 TB/s. Public 910B figures disagree (256-376 TFLOPS FP16)")
_HCCS = ("assumption: Atlas 800 A2 full mesh of HCCS links, 7 peers x 56 GB/s = 392 GB/s one way (commonly reported "
         "figure, no datasheet found); efficiency 0.6 as the Ascend dispatch benchmark above "
         f"({_SGL_NPU}); collective: {_HCCL_FLOOR}; dispatch/combine: assumption: as A3, {_SGL_NPU_LL}")
_ROCE_A2 = ("assumption: one 200 Gb/s RoCE port per NPU (25 GB/s), 0.9 achieved; collective and dispatch/combine "
            f"as InfiniBand ({_NCCL_IB}; {_DEEPEP_LL})")
_UB_NOTE = f"collective: {_HCCL_FLOOR}; dispatch/combine: {_SGL_NPU_LL}"
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
              f"as Ascend A3 ({_SGL_NPU}); assumption: the A3 primitives' alphas hold on A5; {_UB_NOTE}"),
    "inter": "assumption: the Atlas 950 SuperPoD extends the same UB fabric across nodes, so inter = intra",
    "cards_per_node": "assumption: 8 per node, like the A2/A3 servers"}
_UB_A3 = _link(196 * G, 0.6, _NVSWITCH_POINTS, _SGL_NPU_LL_TABLE)
_UB_A5 = _borrowed(_UB_A3, 2.0 * T, 0.6)


def _profile(name, description, hbm, bw, rates, intra, inter, per_node, sources,
             gap=(2.0, _GAP_ASCEND)) -> DeviceProfile:
    """Host and token-sync costs are the same assumptions on every device, cited here once; ``gap``
    is the device gap per kernel and its source (a CUDA-graph figure on NVIDIA parts)."""
    return DeviceProfile(name, description, hbm, bw, rates, _EFFICIENCY, intra, inter, per_node,
                         launch_us=gap[0], host_launch_us=5.0, graph_launch_us=20.0, host_step_us=100.0,
                         token_sync_us=20.0,
                         sources={**sources, "launch_us": gap[1], "host_launch_us": _HOST_LAUNCH,
                                  "graph_launch_us": _GRAPH_LAUNCH, "host_step_us": _HOST_STEP,
                                  "token_sync_us": _TOKEN_SYNC})


_NVIDIA_GAP = (1.3, _GAP_CUDA_GRAPH)
PROFILES = {p.name: p for p in (
    _profile("a2", "Ascend 910B (Atlas 800 A2, 8 per node)", 64 * G, 1.6 * T,
             {"mx": 752 * T, "dense": 376 * T, "vector": 23.5 * T},
             _borrowed(_UB_A3, 392 * G, 0.6), _link(25 * G, 0.9, _IB_POINTS, _DEEPEP_LL_TABLE), 8,
             {"hbm_bytes": _A2, "hbm_bytes_per_s": _A2, "flops_per_s": f"{_A2}; vector: {_VEC_ASCEND}",
              "efficiency": _EFFICIENCY_ASCEND, "intra": _HCCS, "inter": _ROCE_A2,
              "cards_per_node": "Atlas 800 A2: 8 NPUs (vLLM-Ascend DeepSeek-V4-Flash tutorial: 'Atlas 800 A2 (64G x 8)')"}),
    _profile("a3", "Ascend 910C die (Atlas 800 A3 / CloudMatrix384: 8 cards, 16 dies per node)", 64 * G, 1.6 * T,
             {"mx": 752 * T, "dense": 376 * T, "vector": 23.5 * T},
             _UB_A3, _UB_A3, 16,
             {"hbm_bytes": _CLOUDMATRIX, "hbm_bytes_per_s": _CLOUDMATRIX,
              "flops_per_s": f"{_CLOUDMATRIX}; vector: {_VEC_ASCEND}", "efficiency": _EFFICIENCY_ASCEND,
              "intra": f"{_CLOUDMATRIX}; efficiency: {_SGL_NPU}; {_UB_NOTE}",
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
              **_HOPPER}, gap=_NVIDIA_GAP),
    _profile("h100", "NVIDIA H100 SXM (HGX, 8 per node)", 80 * G, 3.35 * T,
             {"mx": 1979 * T, "dense": 989 * T, "vector": 67 * T}, _NVLINK, _IB, 8,
             {"hbm_bytes": "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): 80 GB HBM3 at 3.35 TB/s",
              "hbm_bytes_per_s": "NVIDIA H100 datasheet (above)",
              "flops_per_s": "NVIDIA H100 SXM datasheet: FP8 3,958 / BF16 1,979 TFLOPS with sparsity (half dense); "
                             "FP32 67", **_HOPPER}, gap=_NVIDIA_GAP),
    _profile("b200", "NVIDIA B200 (HGX, 8 per node)", 180 * G, 8.0 * T,
             {"mx": 4500 * T, "dense": 2250 * T, "vector": 75 * T},
             _link(900 * G, 0.77, _NVSWITCH_POINTS, _DEEPEP_LL_NVL_TABLE), _IB, 8,
             {"hbm_bytes": "NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 1,440 GB HBM3e and "
                           "64 TB/s over 8 GPUs -> 180 GB at 8 TB/s per GPU",
              "hbm_bytes_per_s": "NVIDIA DGX B200 datasheet (above)",
              "flops_per_s": "NVIDIA DGX B200 datasheet: FP8 72 PFLOPS training over 8 GPUs -> 9 PFLOPS with "
                             "sparsity, 4.5 dense per GPU; BF16 half that; assumption: FP32 vector 75 TFLOPS "
                             "(not in the datasheet; the Hopper figure scaled by the SM count ratio)",
              **_HOPPER, "efficiency": _EFFICIENCY_SRC + "; assumption: the Hopper fractions hold on Blackwell",
              "intra": "NVLink 5: 1.8 TB/s per GPU both directions (DGX B200 datasheet) -> 900 GB/s one way; "
                       "DeepEP V2 README: EP8 NVLink dispatch/combine 726/740 GB/s on SM100 -> 0.8, 0.77 kept as "
                       f"Hopper; collective: {_NCCL_NVSWITCH}; dispatch/combine: {_DEEPEP_LL_NVL}; "
                       "assumption: NVLink 5 has NVLink 4's small-message floor and DeepEP's NVLink 4 call costs"},
             gap=_NVIDIA_GAP),
    _profile("h20", "NVIDIA H20 (HGX, 8 per node)", 96 * G, 4.0 * T,
             {"mx": 296 * T, "dense": 148 * T, "vector": 44 * T}, _NVLINK, _IB, 8,
             {"hbm_bytes": "NVIDIA H20 product brief as reported by willitrunai.com/gpus/h20-96gb and "
                           "unanswered.io/guide/nvidia-h20-hbm-memory: 96 GB HBM3 at 4.0 TB/s",
              "hbm_bytes_per_s": "NVIDIA H20 product brief as reported above: 4.0 TB/s",
              "flops_per_s": "NVIDIA H20 product brief (as reported above): FP8 296, BF16 148 TFLOPS dense; FP32 44",
              **_HOPPER, "inter": f"assumption: the HGX H20 board carries the same NIC per GPU as HGX H100; {_CX7}"},
             gap=_NVIDIA_GAP),
)}

# ---- this CPU --------------------------------------------------------------------------------------

_CPU_RATES = ("bench/cpu_rates.py on the 2-core development VM with one Torch thread (the engine's, "
              "DSV41_TORCH_THREADS=1), best of 5 at load average 3.3 (a checkpoint writer and a run alongside): "
              "256 MiB FP32 copy 11.70 GB/s (read + write), 2048^3 GEMM FP32 157.7 and FP64 62.7 GFLOP/s, a "
              "1-element torch.add 1.56 us per call; a weight's decode to FP64 and one-row product per value: "
              "FP8 11.03, FP4 7.37, BF16 9.09, FP32 8.74 ns")
_CPU_WEIGHT_USE = ("bench/cpu_roofline.py (issue 29: the weight kernels compiled from LLVM IR, each value decoded in a "
                   "register next to its FP32 multiply-add): the per-value cost of the node kinds of one format in the "
                   "measured steps (bench/results/cpu-roofline-flash-*-fp32.json), less the FP32 multiply-add the FLOPs "
                   "term prices (2 / 157.7 GFLOP/s = 0.013 ns): FP8 and FP4 from the 40-layer step (0.068, 0.043 ns), "
                   "BF16 the mean of the 4- and 40-layer steps' (0.058, 0.087), FP32 bench/weight_kernels.py's one-row "
                   "0.146 (the steps' FP32 products are too small to price it). --replan against those steps: "
                   "flash-L4-E8 batch 1 +12%, batch 8 +1%, flash-L40-E8 batch 1 -20%")
_CPU_LOOPBACK = ("assumption: dask workers on one host talk over loopback TCP; a collective and a dispatch/combine "
                 "call alike cost 100 us per message (the order of a Python asyncio round trip) and the bytes at the "
                 "measured copy bandwidth; not measured")
_CPU_LINK = Link(11.7 * G, 1.0, AlphaBeta(100.0, 11.7 * G), ByRanks(((2, AlphaBeta(100.0, 11.7 * G)),)))
# the kernels multiply FP8/FP4/BF16 weights as held, decoding each value next to its FP32 multiply-add
# (docs/numerics.md), so every matmul class runs at the FP32 GEMM rate plus the decode (weight_use_ns); the
# measured rates are achieved ones
CPU = DeviceProfile(
    "cpu-avx512", "the 2-core development VM with AVX-512 (AMD Zen 5; Torch eager, FP32 weight products)",
    23 * 2 ** 30, 29.2 * G,
    {"mx": 157.7 * G, "dense": 62.7 * G, "vector": 157.7 * G},
    {"matmul": (1.0, 1.0), "gather": (1.0, 1.0), "vector": (1.0, 1.0)}, _CPU_LINK, _CPU_LINK, 8,
    launch_us=1.56, host_launch_us=1.56, graph_launch_us=1.56, host_step_us=100.0, token_sync_us=1.56,
    weight_use_ns={"fp8": 0.055, "fp4": 0.030, "bf16": 0.060, "f32": 0.133}, shared_cores=2,
    sources={"hbm_bytes": "free -b: 23 GiB of RAM on the VM",
             "hbm_bytes_per_s": "bench/cpu_roofline.py's copy bandwidth (a 256 MiB FP32 copy, read + write) in the "
                                "three steps of bench/results/cpu-roofline-flash-*-fp32.json: 29.2, 31.8, 27.6 GB/s; "
                                "the median (bench/cpu_rates.py measured 11.70 GB/s under load)",
             "flops_per_s": _CPU_RATES + "; mx at the FP32 rate (the weight kernels' FP32 multiply-adds), dense at "
                                         "the FP64 rate (the attention leaves' FP64 products; the BF16 head is "
                                         "memory-bound); vector at the FP32 GEMM rate (assumption: an upper bound)",
             "efficiency": "the rates are measured achieved rates (bench/cpu_rates.py), so 1.0",
             "intra": _CPU_LOOPBACK, "inter": _CPU_LOOPBACK,
             "cards_per_node": "assumption: the 8 workers of run 2 share one host",
             "weight_use_ns": _CPU_WEIGHT_USE,
             "shared_cores": "nproc: 2; every card of a run here is a thread (sync, threads) or a process "
                             "(distributed) on them, each Torch op single-threaded (DSV41_TORCH_THREADS=1)",
             "launch_us": _CPU_RATES + ": one eager Torch op's dispatch per kernel",
             "host_launch_us": _CPU_RATES, "graph_launch_us": "no graph capture on CPU: one op's dispatch",
             "host_step_us": _HOST_STEP, "token_sync_us": "the tokens are in host memory already: one op's dispatch to read them"})

_AVX2_RATES = ("bench/cpu_rates.py on the 2-core development VM without AVX-512 (AMD Zen 3, AVX2 and F16C), one "
               "Torch thread, idle: 256 MiB FP32 copy 17.59 GB/s, 2048^3 GEMM FP32 69.8 and FP64 40.0 GFLOP/s, a "
               "1-element torch.add 2.14 us per call")
_AVX2_WEIGHT_USE = ("bench/cpu_roofline.py on that VM: the per-value cost of the node kinds of one format in the "
                    "measured steps less the FP32 multiply-add the FLOPs term prices (2 / 69.8 GFLOP/s = 0.029 ns): "
                    "FP8 and FP4 the medians of four 40-layer steps with the byte-table decodes (0.114, 0.082 ns; "
                    "bench/results/cpu-roofline-flash-L40-E8-b1-avx2-e2m1.json is one), BF16 the mean of the 4- and "
                    "40-layer steps' medians (0.104, 0.133), FP32 bench/cpu_rates.py's one-row 0.26 (docs/flash-shapes.md)")


def _vm(name: str, description: str, bandwidth: float, bandwidth_source: str, fp32: float, fp64: float, op_us: float,
        weight_use_ns: dict, rates: str, weight_use: str) -> DeviceProfile:
    """The ``cpu-avx512`` profile with another development VM's measurements: its bandwidth, FP32 and
    FP64 GEMM rates (GFLOP/s), one small op's cost and per-value weight use, with their sources."""
    return replace(
        CPU, name=name, description=description, hbm_bytes_per_s=bandwidth,
        flops_per_s={"mx": fp32 * G, "dense": fp64 * G, "vector": fp32 * G},
        launch_us=op_us, host_launch_us=op_us, graph_launch_us=op_us, token_sync_us=op_us, weight_use_ns=weight_use_ns,
        sources={**CPU.sources, "hbm_bytes_per_s": bandwidth_source,
                 "flops_per_s": rates + "; mx at the FP32 rate, dense at the FP64 rate, vector at the FP32 rate "
                                        "(as cpu-avx512)",
                 "weight_use_ns": weight_use, "launch_us": rates, "host_launch_us": rates, "graph_launch_us": rates,
                 "token_sync_us": rates})


# the same kernels on a CPU without AVX-512: 8-lane vectors, half the registers, the FP4 and FP8 decodes
# byte shuffles (docs/flash-shapes.md)
CPU_AVX2 = _vm(
    "cpu-avx2", "the 2-core development VM without AVX-512 (AMD Zen 3, AVX2; Torch eager, FP32 weight products)",
    17.4 * G, "bench/cpu_roofline.py's copy bandwidth in the steps of bench/results/cpu-roofline-flash-*-avx2.json: "
              "14.7, 16.2, 18.5 GB/s, and bench/cpu_rates.py's 17.59; their median",
    69.8, 40.0, 2.14, {"fp8": 0.085, "fp4": 0.053, "bf16": 0.089, "f32": 0.231}, _AVX2_RATES, _AVX2_WEIGHT_USE)

_EMR_RATES = ("bench/cpu_rates.py on the 2-core development VM with an Intel Emerald Rapids CPU (LLVM's "
              "emeraldrapids; AVX-512, its BF16 and AMX not exposed to the VM), DSV41_TORCH_THREADS=1, idle: 256 MiB "
              "FP32 copy 12.04 GB/s, 2048^3 GEMM FP32 160.7 and FP64 74.7 GFLOP/s, a 1-element torch.add 1.33 us "
              "per call, a one-row FP32 product 0.27 ns a value")
_EMR_WEIGHT_USE = ("bench/cpu_roofline.py on that VM (bench/results/cpu-roofline-flash-*-avx512-emr-cal*.json): "
                   "the per-value cost of the node kinds of one format in the measured steps less the FP32 "
                   "multiply-add the FLOPs term prices (2 / 160.7 GFLOP/s = 0.012 ns): FP8 and FP4 from the 40-layer "
                   "step (0.111, 0.098 ns), "
                   "BF16 the mean of two 4-layer steps' and the 40-layer step's (0.101, 0.095, 0.101), FP32 "
                   "bench/cpu_rates.py's one-row 0.27 (docs/flash-shapes.md)")
# the AVX-512 kernels on an Intel CPU whose VM copies at less than half the Zen 5 VM's bandwidth; its
# weights stream at about twice its copy rate, so the profile prices reads at the read rate
CPU_EMR = _vm(
    "cpu-avx512-emr",
    "the 2-core development VM with AVX-512 (Intel Emerald Rapids; Torch eager, FP32 weight products)",
    22.0 * G, "bench/weight_kernels.py's one-row BF16 product on both cores, 0.083-0.089 ns a 2-byte value: 22.5-24.1 "
              "GB/s read (a decode step reads its weights and writes little; the copy, read + write, ran at "
              "10.3-12.3 GB/s, and the 4-layer step's BF16 head read 1.32 GB in 53-63 ms)",
    160.7, 74.7, 1.33, {"fp8": 0.099, "fp4": 0.086, "bf16": 0.087, "f32": 0.258}, _EMR_RATES, _EMR_WEIGHT_USE)
# LLVM's names of the CPUs the Emerald Rapids profile stands for (Sapphire Rapids: the same cores,
# assumed, not measured)
_EMR_NAMES = ("sapphirerapids", "emeraldrapids")
PROFILES[CPU.name] = CPU
PROFILES[CPU_AVX2.name] = CPU_AVX2
PROFILES[CPU_EMR.name] = CPU_EMR


# ---- 950PR operators measured in situ (pypto-lib #1054) --------------------------------------------
_PYPTO_1054 = ("hw-native-sys/pypto-lib issue #1054 (cann-recipes-infer DeepSeek-V4-Flash on 8x Ascend 950PR, "
               "section 5.1 'In-situ, from msprof at real shapes', rank 0, batch 8 at 8192 context, decode, the mean "
               "over 3 captured steps): ")
# QuantBatchMatmulV3, its dominant shape: activation [1, 4096] INT8/MXFP8, weight [1024, 4096] one byte a value,
# scales [1024, 64, 2] bytes, output [1, 1024] BF16
_QBMM_BYTES = 4096 + 1024 * 4096 + 1024 * 64 * 2 + 1024 * 2
_QBMM_FLOPS = 2 * 4096 * 1024
_QBMM = _PYPTO_1054 + "QuantBatchMatmulV3, 279 calls a step, 14.83 us a call, dominant input shape 1,4096;1024,4096;1024,64,2"
_SWIGLU = _PYPTO_1054 + "SwigluGroupQuant, 86 calls a step (2 a layer), 19.21 us a call"
_DISPATCH_1054 = (_PYPTO_1054 + "MoeDistributeDispatchV3, 43 calls a step (one a layer), 43.03 us a call at 1 token "
                  "a rank, hidden 4096, top-6 (its bytes are under 0.1 us of the link): the dispatch/combine alpha at "
                  "8 EP ranks. assumption: the combine's call costs what the dispatch's does (the combine's row of "
                  "the same table was not in the excerpt read here)")
# node kind -> quantised matmuls one node runs (the weights it multiplies, kernels/nodes/attention.py and moe.py),
# and whether it runs the shared expert's SwiGLU between them
_GEMMS_1054 = {"attn.q_proj": (2, False), "attn.kv_proj": (1, False), "attn.o_proj": (2, False),
               "moe.shared": (2, True)}


def _with_1054(dev: DeviceProfile) -> DeviceProfile:
    """The 950PR profile with #1054's in-situ operator times: the quantised linears' and the shared
    expert's operators (a measured matmul a call, the SwiGLU's fixed time once), and the dispatch's
    call as the all-to-all's alpha at 8 ranks. Every other node kind stays on the roofline. The same
    issue's full-network step times are held out: nothing here is fitted to them."""
    from dsv41.plan.operators import Point, fit_all
    points = {}
    for kind, (gemms, swiglu) in _GEMMS_1054.items():
        pts = [Point(1 / gemms, _QBMM_BYTES, _QBMM_FLOPS, 0.0, 14.83, "[1, 4096] x [1024, 4096] MXFP8", _QBMM)]
        if swiglu:      # one SwiGLU a node besides its matmuls: measured alone, as its own point's share
            pts = [Point(1 / (gemms + 1), _QBMM_BYTES, _QBMM_FLOPS, 0.0, 14.83 * gemms / (gemms + 1) + 19.21 / (gemms + 1),
                         "[1, 4096] x [1024, 4096] MXFP8 matmuls and a SwiGLU", f"{_QBMM}; {_SWIGLU}")]
        points[kind] = pts
    a2a = ByRanks(tuple((r, AlphaBeta(43.03, ab.bytes_per_s) if r == 8 else ab) for r, ab in dev.intra.a2a.fits))
    link = replace(dev.intra, a2a=a2a)
    dev = replace(dev, intra=link, inter=link,
                  sources={**dev.sources, "intra": f"{dev.sources['intra']}; dispatch/combine at 8 ranks: {_DISPATCH_1054}",
                           "inter": f"{dev.sources['inter']} (with #1054's dispatch call)"})
    return replace(dev, operators=fit_all(points, dev))


PROFILES["a5-pr"] = _with_1054(PROFILES["a5-pr"])


def _this_cpu() -> DeviceProfile:
    """``cpu``: the profile of the kernels this machine runs (AVX-512 or not, as ``cpu.dispatch``
    decides, and the measured VM nearest this one), so that a plan for ``--device-profile cpu`` prices
    the step this CPU will run."""
    import llvmlite.binding as llvm

    from dsv41.cpu.dispatch import host_lanes
    if host_lanes() != 16:
        return CPU_AVX2
    return CPU_EMR if llvm.get_host_cpu_name() in _EMR_NAMES else CPU


PROFILES["cpu"] = _this_cpu()
