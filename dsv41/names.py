"""The executor names, stated once: the command line offers them, the engines accept them."""

LOCAL_EXECUTORS = ("sync", "threads")                    # dask's in-process schedulers
GRAPH_EXECUTORS = LOCAL_EXECUTORS + ("distributed",)     # the ones that run the task graph
REFERENCE = "reference"                                  # the monolithic model, no graph
EXECUTORS = GRAPH_EXECUTORS + (REFERENCE,)
# Measured on the default TINY run (README, "Choosing an executor"): threads finished first in three
# of four pairs on this shared 2-core machine, for the same CPU time. Revisit when the executors change.
DEFAULT_EXECUTOR = "threads"
