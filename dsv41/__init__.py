"""DeepSeek-V4.1-Flash inference as a task-graph dataflow pipeline on Dask."""
import os

from dsv41.cli import interrupt

interrupt.install()     # Ctrl-C during the seconds torch and the rest take to import: one line, status 130
import torch  # noqa: E402

# One intra-op thread per process: parallelism comes from the executors (one dask thread or worker
# per card). On this 2-core CPU, torch's own thread pool on many tiny ops oversubscribes the cores
# and made a TINY decode step ~5x slower under load. DSV41_TORCH_THREADS overrides it.
torch.set_num_threads(int(os.environ.get("DSV41_TORCH_THREADS", "1")))
