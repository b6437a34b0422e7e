"""Preloaded into every LocalCluster worker process (``dask_setup``, dask's preload hook).

The workers share the run's process group, so the terminal's Ctrl-C and a SIGTERM sent to the group
reach them too: each would die mid-task with a traceback, and the run's orderly close would wait on
workers that are already gone. They ignore both; the run closes the cluster, and a worker whose
parent dies exits on its own (dask's parent-alive pipe).
"""
import signal


def dask_setup(worker=None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
