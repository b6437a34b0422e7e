"""Card State owned by its engine: engines side by side in one process, runs sharing one scheduler,
lost workers recovered to the tokens of an undisturbed run, complete aborts, empty batches.

Oracle: ``ReferenceEngine`` with the same seed (the graph gives its tokens on every layout)."""
import functools
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import cloudpickle
import pytest
import torch

from dsv41.cli import run
from dsv41.cluster import registry
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.cluster.runtime import NodeError
from dsv41.config import TINY, Topology
from dsv41.engine.reference import ReferenceEngine
from ports import free_ports, start_scheduler

PROMPTS = [[5, 9, 100, 7], [11, 2, 3]]
CTX = 12
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # _digest runs on the workers
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def reference_tokens(seed: int, steps: int) -> list[list[int]]:
    """Argmax tokens after the prefill and after each of ``steps`` greedy decodes."""
    ref = ReferenceEngine(TINY, seed=seed, max_batch=2, max_context=CTX)
    toks = [torch.argmax(ref.prefill(PROMPTS).logits, -1).tolist()]
    for _ in range(steps):
        toks.append(torch.argmax(ref.decode(toks[-1]).logits, -1).tolist())
    return toks


def engine_for(topo, seed=0, executor="threads", **kw):
    return GraphEngine(TINY, topo, EngineConfig(seed=seed, executor=executor, max_batch=2, max_context=CTX, **kw))


def next_tokens(engine, logits=None, prompts=PROMPTS):
    out = engine.prefill(prompts).logits if logits is None else engine.decode(torch.argmax(logits, -1).tolist()).logits
    return out, torch.argmax(out, -1).tolist()


def _digest(engine_id: str) -> dict[int, tuple[str, int, int]]:
    """card -> (sha256 of every committed cache byte, staged tensors, generation) of the States in this
    process: compares States across processes without moving them."""
    out = {}
    for card, st in registry.owned(engine_id).states.items():
        h = hashlib.sha256()
        for name in sorted(st.caches.committed):
            for t in st.caches.committed[name]:
                h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out[card] = (h.hexdigest(), st.caches.pending, st.generation)
    return out


def digest(engine):
    if engine.runner is None:
        return _digest(engine.id)
    return {c: d for r in engine.runner.run_on_cards(_digest, engine.id).values() for c, d in r.items()}


def host_tables(engine):
    return [(repr(t.requests), repr(t.pools)) for t in engine.host.tables]


# ---- one process --------------------------------------------------------------------------------------

def test_empty_batches_raise_before_any_node_runs():
    engine = engine_for(Topology(1, 1, 1), executor="sync")
    for call in (lambda: engine.prefill([]), lambda: engine.decode([], []), lambda: engine.decode([])):
        with pytest.raises(ValueError, match="batch"):
            call()
    assert engine.step_id == 0 and engine.generation == 0 and engine.last_graph is None
    engine.close()
    assert engine.id not in registry.engines()


@pytest.mark.timeout(300)
def test_three_engines_interleaved_give_their_solo_tokens():
    a = engine_for(Topology(1, 1, 1), seed=0, executor="sync")
    la, ta0 = next_tokens(a)
    b = engine_for(Topology(2, 1, 2), seed=1, executor="threads")   # built after a's prefill
    lb, tb0 = next_tokens(b)
    _, ta1 = next_tokens(a, la)
    c = engine_for(Topology(1, 2, 2), seed=0, executor="threads")
    lc, tc0 = next_tokens(c)
    _, tb1 = next_tokens(b, lb)
    _, tc1 = next_tokens(c, lc)
    assert [ta0, ta1] == reference_tokens(0, 1)
    assert [tb0, tb1] == reference_tokens(1, 1)
    assert [tc0, tc1] == reference_tokens(0, 1)
    a.close()
    assert a.id not in registry.engines() and {b.id, c.id} <= set(registry.engines())
    for e in (b, c):
        e.close()


@pytest.mark.timeout(300)
def test_lost_card_state_in_process_is_rebuilt_by_replay(caplog):
    engine = engine_for(Topology(1, 2, 2), seed=0, executor="threads")
    logits, _ = next_tokens(engine)
    ids = engine.active
    registry.find(engine.id).states.pop(1)          # card 1 (DP group 1) lost its State
    with caplog.at_level("WARNING", logger="dsv41.cluster.engine"):
        logits, t1 = next_tokens(engine, logits)
    assert t1 == reference_tokens(0, 2)[1]
    assert engine.active == engine.last_request_ids == ids      # replayed under the ids they had
    rec = engine.last_stats["recovered"][0]
    assert (rec["lost_cards"], rec["rebuilt_cards"], rec["replayed_requests"]) == ([1], [1], 1)
    assert "recovered card(s) [1]" in caplog.text
    engine.states()[0].generation += 5              # a stale State is a loss too, never computed through
    _, t2 = next_tokens(engine, logits)
    assert t2 == reference_tokens(0, 2)[2]
    assert engine.last_stats["recovered"][0]["lost_cards"] == [0]
    engine.close()


def _failures_leave_state_untouched(engine, targets):
    logits, _ = next_tokens(engine)
    before, tables = digest(engine), host_tables(engine)
    for target in targets:
        engine.inject_failure(target)
        with pytest.raises(NodeError, match=f"node {target}"):
            next_tokens(engine, logits)
        assert digest(engine) == before and host_tables(engine) == tables, target
    _, again = next_tokens(engine, logits)               # fired once: the retry runs clean
    assert again == reference_tokens(0, 1)[1]


def _random_targets(engine, n, seed):
    engine.prefill([[1]])                                # a throwaway step: the decode graph's keys
    keys = sorted(k for k in engine.last_graph.nodes if "/index#" not in k)
    engine.release(engine.last_request_ids[0])
    return random.Random(seed).sample(keys, n) + ["cache.commit@c1"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor,n", [("sync", 2), ("threads", 6)])
def test_injected_failures_abort_completely(executor, n):
    engine = engine_for(Topology(2, 1, 2), executor=executor)
    targets = _random_targets(engine, n, seed=len(executor))
    _failures_leave_state_untouched(engine, targets)
    engine.close()


# ---- dask.distributed ------------------------------------------------------------------------------

def _pid(engine, card):
    addr = engine.runner.address_of[card]
    return engine.runner.client.run(os.getpid, workers=[addr])[addr]


def _kill_when_step_runs_on(engine, card):
    """SIGKILL the card's worker as soon as one of the engine's tasks is on it (mid-step)."""
    addr, pid = engine.runner.address_of[card], _pid(engine, card)

    def watch():
        while True:
            if any(engine.id in str(k) for k in engine.runner.client.processing([addr]).get(addr, ())):
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _served_again(engine, card):
    """Wait until a new worker process (a new server id) serves the card; its address."""
    old = engine.runner.members[card][1]
    while True:
        engine.runner.refresh()
        if engine.runner.members.get(card, (None, old))[1] != old:
            return engine.runner.address_of[card]
        time.sleep(0.2)


def _recovers_between_and_mid_step(address, same_address: bool):
    engine = engine_for(Topology(2, 1, 2), executor="distributed", address=address, recovery_timeout=60)
    try:
        logits, _ = next_tokens(engine)
        before = engine.runner.address_of[1]
        os.kill(_pid(engine, 1), signal.SIGKILL)          # between steps; the nanny starts a new, empty worker
        assert (_served_again(engine, 1) == before) == same_address
        t0 = time.perf_counter()
        logits, t1 = next_tokens(engine, logits)
        between_s = time.perf_counter() - t0             # detection, rebuild, replay and the step
        assert t1 == reference_tokens(0, 2)[1]
        assert engine.last_stats["recovered"][0]["lost_cards"] == [1]
        watcher = _kill_when_step_runs_on(engine, 0)      # in the middle of the next step
        t0 = time.perf_counter()
        _, t2 = next_tokens(engine, logits)
        mid_s = time.perf_counter() - t0
        watcher.join(5)
        assert not watcher.is_alive()
        assert t2 == reference_tokens(0, 2)[2]
        assert 0 in engine.last_stats["recovered"][0]["lost_cards"]
        print(f"recovery: between steps {between_s:.1f} s, mid-step {mid_s:.1f} s")
    finally:
        engine.close()


@pytest.fixture(scope="module")
def local_cluster():
    from distributed import LocalCluster
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                           silence_logs=40)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.mark.slow        # the same abort as sync and threads (test_injected_failures_abort_completely), on a cluster
@pytest.mark.timeout(300)
def test_distributed_injected_failures_abort_completely(local_cluster):
    engine = engine_for(Topology(2, 1, 2), executor="distributed", address=local_cluster.scheduler_address)
    try:
        _failures_leave_state_untouched(engine, _random_targets(engine, 2, seed=5))
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_worker_killed_on_local_cluster_is_recovered(local_cluster):
    _recovers_between_and_mid_step(local_cluster.scheduler_address, same_address=False)


class ExternalCluster:
    """``dask scheduler`` and named workers, each started with subprocess and stopped by PID. Each
    worker keeps its port (a killed worker comes back at the same address, with empty memory); the
    scheduler and the nannies take theirs when they bind (port 0), so no port is chosen before its
    server binds it but the workers'."""

    def __init__(self, folder):
        self.env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.ports = dict(zip(("0", "1"), free_ports(2)))
        self.procs = {}
        self.procs["scheduler"], self.address = start_scheduler(folder, env=self.env)

    def start_worker(self, name: str):
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--name", name, "--nthreads", "1",
             "--worker-port", str(self.ports[name]), "--no-dashboard"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start_workers(self, client, timeout_s=120):
        """Both workers, waited for; one that exits first (another program bound its port after it
        was chosen) is started again on a new port."""
        for name in ("0", "1"):
            self.start_worker(name)
        deadline = time.monotonic() + timeout_s
        while len(client.scheduler_info()["workers"]) < 2:
            for name in ("0", "1"):
                if self.procs[name].poll() is not None:
                    self.ports[name] = free_ports(1)[0]
                    self.start_worker(name)
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(client.scheduler_info()['workers'])}/2 workers arrived "
                                   f"after {timeout_s} s")
            time.sleep(0.2)

    def stop(self, name: str):
        p = self.procs.pop(name)
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def external_cluster(tmp_path_factory):
    cluster = ExternalCluster(tmp_path_factory.mktemp("scheduler"))
    try:
        from distributed import Client
        with Client(cluster.address, timeout=60) as client:
            cluster.start_workers(client)
        yield cluster
    finally:
        for name in [n for n in cluster.procs if n != "scheduler"] + ["scheduler"]:
            cluster.stop(name)


@pytest.mark.timeout(300)
def test_two_concurrent_cli_runs_on_one_scheduler_give_local_results(external_cluster, capsys):
    args = ["--tp", "2", "--dp", "1", "--batch", "2", "--prompt-len", "4", "--new-tokens", "2", "--json"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    runs = []
    for _ in range(2):
        runs.append(subprocess.Popen([sys.executable, "-m", "dsv41.run", "--executor", "distributed", "--address",
                                      external_cluster.address, *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True))
        time.sleep(2)
    try:
        outs = [p.communicate(timeout=240)[0] for p in runs]
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in runs] == [0, 0]
    assert run.main(["--executor", "threads", *args]) == 0
    local = json.loads(capsys.readouterr().out)["last_logits_sha256"]
    assert [json.loads(o)["last_logits_sha256"] for o in outs] == [local, local]


@pytest.mark.slow        # the recovery of test_worker_killed_on_local_cluster_is_recovered, the worker back at its address
@pytest.mark.timeout(300)
def test_worker_killed_on_fixed_port_cluster_is_recovered(external_cluster):
    _recovers_between_and_mid_step(external_cluster.address, same_address=True)


@pytest.mark.timeout(300)
def test_a_card_without_worker_fails_clearly_and_recovers_once_one_is_back(external_cluster):
    from dsv41.cluster.executors import CardUnavailable
    engine = engine_for(Topology(2, 1, 2), executor="distributed", address=external_cluster.address,
                        recovery_timeout=2)
    try:
        logits, _ = next_tokens(engine)
        tables = host_tables(engine)
        external_cluster.stop("1")                        # worker and nanny gone
        with pytest.raises(CardUnavailable, match=r"card\(s\) \[1\]: no worker named 1"):
            next_tokens(engine, logits)
        assert host_tables(engine) == tables and engine.generation == 1
        external_cluster.start_worker("1")
        engine.runner.client.wait_for_workers(2, timeout=120)
        _, t1 = next_tokens(engine, logits)
        assert t1 == reference_tokens(0, 1)[1] and engine.last_stats["recovered"][0]["lost_cards"] == [1]
    finally:
        engine.close()
