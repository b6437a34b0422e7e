"""One record per graph node kind: everything the runtime, the check, the plan and the pypto
simulation know about a kernel name. The records live by subject in ``kernels/nodes/``; the
registry of them all is ``kernels/kinds.KINDS``.

Launch counts (``NodeKind.launches``) are a named assumption: how many device kernels a serving
stack runs for one node of the graph, each paying the device's per-kernel gap (``plan/latency``).
The counts follow one rule applied to the decode path of vLLM's DeepSeek-V3.2 model
(``vllm/model_executor/models/deepseek_v2.py``: ``DeepseekV2MLAAttention`` with the sparse
``Indexer``, ``DeepseekV2MoE`` on ``FusedMoE``), the closest published stack to V4's node kinds: a
quantised linear is two kernels (per-token-group FP8 or INT8 quantisation of the activation, then
the GEMM); a norm, a RoPE, a cache write, a top-k and an activation are one each (vLLM's fused
``fused_add_rms_norm``, ``rotary_embedding``, ``concat_and_cache_mla``, ``silu_and_mul`` custom ops);
sparse attention decode is two (the FlashMLA-style metadata kernel, then the attention kernel); a
dispatch or combine is one kernel of the all-to-all library (DeepEP low-latency) plus, for dispatch,
its layout kernel. V4's mHC nodes (not in V3.2) follow the same rule on the operations the seed spec
gives them. Where a count is uncertain it is the smaller one, so the launch term is a lower bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

LATENCY_CLASSES = ("matmul", "gather", "vector")   # the keys of a DeviceProfile's efficiency
# How a node hands data between cards. ``collective``: one member of a TP collective (the graph
# checks its group, the roofline runs it on the card's comm stream, the latency model prices it by the
# collective primitive); ``all_to_all``: it receives the EP all-to-all (priced by that primitive, its
# bytes scaled by the MoE load imbalance); ``none``: neither (bytes it takes from peers, as
# ``lm_head.argmax``'s gather, are priced as one collective call).
COMM_CLASSES = ("none", "collective", "all_to_all")


@dataclass(frozen=True)
class NodeKind:
    name: str                            # the kernel name graph nodes carry (``node.kernel``)
    run: Callable                        # (state, node, *inputs) -> value: the Torch kernel
    cost: Callable                       # (ctx, node, *inputs) -> kernels.cost.Cost
    launches: tuple = ()                 # (kernels a serving stack runs for one node, the operations counted)
    comm: str = ""                       # one of COMM_CLASSES
    calls: Callable | None = None        # (node) -> collective calls it makes (alphas it pays); None: one
    routed: bool = False                 # its FLOPs are routed (token, expert) pairs: the busiest rank's grow
    #                                      with the MoE load imbalance
    latency: str = "vector"              # which of the profile's achievable fractions bound its body
    pypto_parts: Callable | None = None  # (cfg, rows, tp, ep) -> [(pypto kernel, shapes)]: the pypto calls
    #                                      one node stands for on one card at ``rows`` tokens per DP group
    no_pypto_parts: str = ""             # why the pypto simulation has no parts for it
    sim_rows: Callable | None = None     # (state, node, args) -> the rows its pypto parts run at (0: no time)
    pypto: Callable | None = None        # node-level pypto form for the check: (state, node, *args) ->
    #                                      (pypto kernel, inputs, extra shapes, dtypes, outputs -> value)
    no_pypto: str = ""                   # why a kernel pypto does simulate has no node-level form
    effects: bool = False                # writes caches: running it again (the check) would stage twice
    compare: Callable | None = None      # (state, node, actual, golden) -> Verdict where equality is too strict

    def __post_init__(self):
        if self.latency not in LATENCY_CLASSES:
            raise ValueError(f"NodeKind {self.name!r}: latency must be one of {LATENCY_CLASSES}, "
                             f"got {self.latency!r}")
        if self.pypto is not None and self.no_pypto:
            raise ValueError(f"NodeKind {self.name!r}: a node-level pypto form and a reason it has none")
        count, what = self.launches if len(self.launches) == 2 else (None, "")
        if not (isinstance(count, int) and count >= 1 and isinstance(what, str) and what):
            raise ValueError(f"NodeKind {self.name!r}: launches must be (kernels >= 1, the operations "
                             f"counted), got {self.launches!r}")
        if self.comm not in COMM_CLASSES:
            raise ValueError(f"NodeKind {self.name!r}: comm must be one of {COMM_CLASSES}, got {self.comm!r}")
        if self.calls is not None and self.comm != "collective":
            raise ValueError(f"NodeKind {self.name!r}: collective calls on a kind whose comm is {self.comm!r}")
        if (self.pypto_parts is None) == (not self.no_pypto_parts):
            raise ValueError(f"NodeKind {self.name!r}: needs exactly one of pypto_parts and no_pypto_parts "
                             f"(the reason it has none)")
        if (self.pypto_parts is None) != (self.sim_rows is None):
            raise ValueError(f"NodeKind {self.name!r}: pypto_parts and sim_rows go together")

    @property
    def kernels(self) -> int:
        """Kernels a serving stack launches for one node of this kind."""
        return self.launches[0]
