"""dask.distributed worker plugin: each worker builds and holds the State of its own card."""
from __future__ import annotations

from distributed.diagnostics.plugin import WorkerPlugin

from dsv41.cluster import state as card_state
from dsv41.config import Topology


class CardStatePlugin(WorkerPlugin):
    """Builds the State of the card named like the worker (workers are named by card id)."""
    name = "dsv41-card-state"

    def __init__(self, cfg_name: str, topo: Topology, seed: int, max_batch: int, max_context: int,
                 checkpoint=None):
        self.args = (cfg_name, topo, seed, max_batch, max_context, checkpoint)

    def setup(self, worker):
        from dsv41.config import PRESETS
        cfg_name, topo, seed, max_batch, max_context, checkpoint = self.args
        cfg = PRESETS[cfg_name] if checkpoint is None else checkpoint.cfg
        card = int(worker.name)
        card_state.STATES.clear()
        card_state.STATES.update(card_state.build_states(cfg, topo, seed, [card], max_batch, max_context,
                                                         checkpoint=checkpoint))

    def teardown(self, worker):
        card_state.STATES.clear()
