"""A ``GraphEngine``'s settings, in one object checked before anything is built.

The model (``ModelConfig``), the topology and the checkpoint say what runs; these say how: the
executor and its granularity, the TP wiring, the capacity per DP group, the requests and context the request tables hold,
the tokens their cache pools hold and whether they keep a prefix cache, the cluster to join, the kernel backend, and how long a
step waits for a lost card's worker.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv41.cluster.connect import Startup
from dsv41.capacity import Capacity
from dsv41.graph.build import SHARDED
from dsv41.kernels.device_time import BACKENDS
from dsv41.model.options import FULL_PREFILL, Options
from dsv41.names import GRAPH_EXECUTORS

RECOVERY_TIMEOUT_S = 60.0    # how long a step waits for a worker to serve a lost card
GRAPH_CACHE = 16             # planned graphs kept, one per step shape (0: rebuild every step)


@dataclass(frozen=True)
class EngineConfig:
    seed: int = 0                          # random weights (without a checkpoint) and drawn contexts
    executor: str = "threads"
    granularity: str = "submission"        # one dask task per submission, or per node
    wiring: str = SHARDED
    capacity: Capacity | None = None       # the limits per DP group (default: the checkpoint's or the model's,
    #                                        ``dsv41.capacity``)
    max_batch: int | None = None           # requests at once over all DP groups (default: the capacity's per group)
    max_context: int | None = None         # tokens per request (default: min(context limit, 1024))
    cache_tokens: int | None = None        # what each DP group's compressed pools hold (default: every
    #                                        request at max_context; ``RequestTable``)
    prefix_caching: bool = False           # each DP group keeps the pages of prompt prefixes it computed for
    #                                        later requests placed there (``engine.prefix_cache``)
    options: Options = Options()
    backend: str = "torch"
    address: str | None = None             # a dask scheduler to join (distributed)
    dashboard: bool = False
    startup: Startup = Startup()           # how long to wait for the cluster, whom to tell as workers join
    recovery_timeout: float = RECOVERY_TIMEOUT_S
    graph_cache: int = GRAPH_CACHE

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {self.backend!r}")
        if self.executor not in GRAPH_EXECUTORS:
            raise ValueError(f"executor: must be one of {GRAPH_EXECUTORS}, got {self.executor!r}")
        if self.granularity not in ("submission", "node"):
            raise ValueError(f"granularity: must be 'submission' or 'node', got {self.granularity!r}")
        if self.options.prefill_mode != FULL_PREFILL:
            raise ValueError(f"options.prefill_mode: the graph runs the full prefill only ({FULL_PREFILL!r}); "
                             f"{self.options.prefill_mode!r} is the reference engine's")
