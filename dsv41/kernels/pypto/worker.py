"""The process that runs pypto: one kernel call per request, pickled over an inherited socket.

pypto keeps global scope state (not thread safe) and some bad configs exit(1) or segfault, so it
never runs in the caller's process. The worker's fd 1/2 go to a log file for its whole life, so its
C++ backtraces and child scripts never print over the caller's console.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import time
import traceback
from pathlib import Path

import psutil

from dsv41.kernels.pypto import env as pypto_env
from dsv41.outputs import open_append

CYCLES_PER_US = 1800.0  # what pypto's own swimlane script divides by (--time_convert_denominator)
# pypto 0.2.0 keeps every call's compiled kernel loaded (~45 MB a pass-verify call on this CPU, most
# of a SIM call's peak), so a worker past this RSS retires after its reply and the next call starts a
# fresh one. A call adds up to ~2.3 GB at the FLASH shapes (lm_head at 192 rows, a 6-expert slice),
# so starting every call below 1.5 GB keeps a worker under 4 GB.
MAX_RSS_BYTES = int(float(os.environ.get("DSV41_PYPTO_WORKER_MAX_GB", 1.5)) * 2 ** 30)


def e2e_us(outdir: Path) -> tuple[float, int]:
    """AICore end-to-end µs (first task start to last task end on AIC/AIV cores) and the task count."""
    sw = json.loads((Path(outdir) / "CostModelSimulationOutput" / "_simulate.swim.json").read_text())
    tasks = [t for core in sw if core.get("coreType") in ("AIC", "AIV") for t in core.get("tasks", [])]
    if not tasks:
        raise RuntimeError(f"no AIC/AIV tasks in {outdir}")
    return (max(t["execEnd"] for t in tasks) - min(t["execStart"] for t in tasks)) / CYCLES_PER_US, len(tasks)


def _plogs(root: Path) -> dict[Path, int]:
    return {f: f.stat().st_size for f in (root / "log").rglob(f"pypto-log-{os.getpid()}_*.log")}


def _plog_errors(root: Path, mark: dict[Path, int], limit: int = 6) -> str:
    """pypto's real reason for a failure is in its plog (written since ``mark``), not in the exception."""
    lines = []
    for f in sorted(_plogs(root)):
        with open(f, "rb") as fh:
            fh.seek(mark.get(f, 0))
            text = fh.read().decode(errors="replace")
        lines += [ln.strip() for ln in text.splitlines() if "[ERROR]" in ln]
    seen = [ln.split("]:", 1)[-1] for ln in lines if "idx < size_" not in ln]  # benign, logged on success too
    return " | ".join(seen[-limit:])


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


class _Runner:
    def __init__(self, mode: str, root: Path):
        self.mode, self.root = mode, root
        import pypto  # noqa: F401  (after the env is set: pypto reads its paths at import)
        self.out = Path(os.environ["TILE_FWK_OUTPUT_DIR"])
        if mode == "verify":
            self._enable_verify()
        if mode == "npu":
            pypto_env.check_npu()

    def _enable_verify(self):
        """pass-verify calculator with the 0.2.0 CPU fix: hand it the real tensors (see the notes, §5)."""
        import pypto
        from pypto._utils import BuildOnlineManager
        from pypto.frontend.parser import entry

        pypto_env.load_calculator(pypto_env.build_calculator(self.root))

        def setup_verify_data(tensors):
            if not pypto.get_verify_options().get("enable_pass_verify"):
                return
            BuildOnlineManager().build_and_load_calculator()
            pypto.pypto_impl.SetVerifyData(entry._pto_to_tensor_data(tensors), [],
                                           entry._pto_verify_datas.get_data())

        entry.JitCallableWrapper._setup_verify_data = staticmethod(setup_verify_data)
        self.dump = self.root / "verify"
        pypto.set_verify_options(enable_pass_verify=True, pass_verify_pass_filter=[],
                                 pass_verify_save_tensor_dir=str(self.dump))

    def _new_outputs(self, before: set) -> list[Path]:
        # only this process's dirs (pypto names them by pid): other workers may share the folder
        return sorted(p for p in self.out.glob(f"output_*_{os.getpid()}_*") if p not in before)

    def call(self, kernel: str, shapes: dict, dtypes: dict, args: list | None):
        from dsv41.kernels.pypto.specs import PYPTO_KERNELS
        spec = PYPTO_KERNELS[kernel]
        if args is None:  # timing only: values are irrelevant, index tables must be in range
            args = spec.to_layout(_zeros(spec, shapes, dtypes), shapes, dtypes)
        fn = spec(shapes, dtypes, self.mode)
        outs_at = [i for i, a in enumerate(spec.args(shapes, dtypes)) if a.kind == "out"]
        names = [a.name for a in spec.args(shapes, dtypes)]
        if self.mode == "npu":
            return self._call_npu(fn, args, {names[i]: i for i in outs_at})
        before = set(self.out.glob(f"output_*_{os.getpid()}_*"))
        t0 = time.perf_counter()
        try:
            fn(*args)
            wall = time.perf_counter() - t0
            outs = self._new_outputs(before)
            if self.mode == "verify":
                return {"ok": True, "outputs": {names[i]: args[i] for i in outs_at}, "wall_s": wall}
            if not outs:
                raise RuntimeError("pypto wrote no output_* dir")
            us, n = e2e_us(outs[-1])
            return {"ok": True, "us": us, "tasks": n, "wall_s": wall}
        finally:
            for p in self._new_outputs(before):
                shutil.rmtree(p, ignore_errors=True)
            if self.mode == "verify":
                shutil.rmtree(self.dump, ignore_errors=True)

    def _call_npu(self, fn, args, outs: dict[str, int]):
        """Device time of the second launch (the first compiles; NPU runs reuse the KernelModule),
        and the first launch's outputs so verify_kernel(mode="npu") can check real device values."""
        import torch
        dev = [a.to("npu") for a in args]
        t0 = time.perf_counter()
        fn(*dev)
        torch.npu.synchronize()
        wall = time.perf_counter() - t0
        values = {name: dev[i].cpu() for name, i in outs.items()}
        start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
        start.record()
        fn(*dev)
        end.record()
        torch.npu.synchronize()
        return {"ok": True, "us": start.elapsed_time(end) * 1000.0, "tasks": None, "wall_s": wall,
                "outputs": values}


def _zeros(spec, shapes, dtypes) -> dict:
    import torch
    from dsv41.kernels.pypto.specs import TORCH_DTYPES
    return {a.name: torch.zeros(a.shape, dtype=TORCH_DTYPES[a.dtype])
            for a in spec.args(shapes, dtypes) if a.kind == "in"}


def main(conn, mode: str, root: str) -> None:
    """Worker loop: recv (kernel, shapes, dtypes, args|None), send a result dict; None stops it."""
    def send(obj):
        conn.send_bytes(pickle.dumps(obj))

    root_p = Path(root)
    os.environ.update(pypto_env.worker_env(root_p))
    os.environ["PATH"] = f"{pypto_env.python3_shim(root_p)}{os.pathsep}{os.environ.get('PATH', '')}"
    log = open_append(root_p / f"worker-{mode}.log")  # the parent rotates it
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        runner = _Runner(mode, root_p)
    except BaseException as e:  # report why the worker cannot start instead of dying silently
        send({"ok": False, "error": f"worker start failed: {_first_line(e)}"})
        return
    import pypto
    send({"ok": True, "ready": True, "pid": os.getpid(), "arch": str(pypto.platform.npuarch)})
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if msg is None:
            return
        mark = _plogs(root_p)
        try:
            reply = runner.call(*msg)
        except BaseException as e:
            traceback.print_exc()
            reason = _plog_errors(root_p, mark)
            reply = {"ok": False, "error": _first_line(e) + (f" [plog: {reason}]" if reason else "")}
        if reply.get("ok") and psutil.Process().memory_info().rss > MAX_RSS_BYTES:
            reply["retire"] = True
        send(reply)
        if not reply.get("ok") or reply.get("retire"):
            return  # a failed call leaves pypto's global scope open ("function nested is not allowed")


if __name__ == "__main__":  # started by sim.PyptoWorker: argv = fd mode root
    from multiprocessing.connection import Connection
    main(Connection(int(sys.argv[1])), sys.argv[2], sys.argv[3])
