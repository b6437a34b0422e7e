"""dask.distributed worker plugin: each worker builds and holds the State of its own card."""
from __future__ import annotations

from distributed.diagnostics.plugin import WorkerPlugin

from dsv41.cluster import state as card_state
from dsv41.config import Topology


class CardStatePlugin(WorkerPlugin):
    """Builds the State of the card named like the worker (workers are named by card id). ``source``
    (default: a draw from ``seed``) must pickle cheaply: a reader that opens its files on the worker."""
    name = "dsv41-card-state"

    def __init__(self, cfg_name: str, topo: Topology, seed: int, max_batch: int, max_context: int, source=None):
        self.args = (cfg_name, topo, seed, max_batch, max_context)
        self.source = source

    def setup(self, worker):
        from dsv41.config import PRESETS
        cfg_name, topo, seed, max_batch, max_context = self.args
        card = int(worker.name)
        card_state.STATES.clear()
        cfg = self.source.cfg if self.source is not None else PRESETS[cfg_name]
        card_state.STATES.update(card_state.build_states(cfg, topo, seed, [card], max_batch,
                                                         max_context, source=self.source))
        _return_freed_memory()

    def teardown(self, worker):
        card_state.STATES.clear()


def _return_freed_memory():
    """Hand the freed weight draw back to the OS: glibc keeps freed heap pages, so the worker's RSS
    would stay at the whole model's size although it holds one card's shard."""
    import ctypes
    import ctypes.util
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
