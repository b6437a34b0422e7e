"""Where pypto's files go, the silent python3 shim, and the pass-verify calculator built once.

Kept free of ``import pypto`` (3 s) so the parent process and the fast tests never pay for it.
"""
from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from dsv41.outputs import write_output

REPO = Path(__file__).resolve().parents[3]
NPU_HINT = "pypto-npu needs an Ascend NPU and torch_npu"
# The chip pypto 0.2.0's SIM models: Ascend 910B (DAV_2201), read from the platform file beside its
# library; arch 3510 (A5) can only be forced by patching that file, and its cost model then prices
# FP8 as BF16 and refuses the MX cube path (docs/pypto.md, "Arch 3510").
SIM_ARCH = "a2"
NPU_ARCHS = {"DAV_2201": "a2", "DAV_3510": "a5"}  # pypto.platform.npuarch -> device profile name


def run_dir(path: str | os.PathLike | None = None) -> Path:
    """pypto's run files: ``traces/pypto-run`` under the working directory at the time of the call."""
    return Path(path or os.environ.get("DSV41_PYPTO_RUN_DIR") or Path.cwd() / "traces" / "pypto-run").resolve()


def cache_file() -> Path:
    """The simulated-times cache, shared by every working directory: under the user's cache (XDG)."""
    if os.environ.get("DSV41_PYPTO_CACHE"):
        return Path(os.environ["DSV41_PYPTO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsv41" / "pypto" / "sim_times.json"


def check_npu() -> None:
    """Raise a RuntimeError naming what is missing for ``--backend pypto-npu``."""
    try:
        import torch_npu  # noqa: F401
    except Exception as e:  # ImportError, or a broken CANN install raising anything else
        raise RuntimeError(f"{NPU_HINT}: torch_npu is not importable ({type(e).__name__}: {e})") from e
    import torch
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        raise RuntimeError(f"{NPU_HINT}: torch_npu imported but torch.npu.is_available() is False")


def worker_env(root: Path) -> dict[str, str]:
    """Env for a pypto worker: all of its files under ``root``, none in the working directory or ~."""
    dirs = {"TILE_FWK_OUTPUT_DIR": root / "out", "PYPTO_HOME": root / "home",
            "ASCEND_PROCESS_LOG_PATH": root / "log"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {k: str(v) for k, v in dirs.items()}


def python3_shim(root: Path) -> Path:
    """A no-op ``python3`` for pypto's swimlane-drawing child scripts: silent and 0.2-0.4 s faster.

    Only the children run ``python3`` from PATH; the worker itself is already running.
    """
    shim = root / "shim"
    exe = shim / "python3"
    if not exe.exists():
        shim.mkdir(parents=True, exist_ok=True)
        write_output(exe, "#!/bin/sh\nexit 0\n", mode=0o755)  # renamed into place: two workers may race here
    return shim


def _torch_facts() -> tuple[str, str, int]:
    import torch
    return str(torch.__version__), str(Path(torch.__file__).parent), int(torch._C._GLIBCXX_USE_CXX11_ABI)


def calculator_path(root: Path) -> Path:
    version = _torch_facts()[0].replace("+", "_")
    return root / "calculator" / f"torch-{version}" / "install" / "lib" / "libtile_fwk_calculator.so"


def build_calculator(root: Path, jobs: int = 2, log=None) -> Path:
    """Build pypto's lib/calculator once into ``root`` (pypto itself rebuilds it in a temp dir per process).

    Same cmake invocation as ``pypto._utils.BuildOnlineManager``; 1-2 minutes on 2 cores.
    """
    so = calculator_path(root)
    if so.exists():
        return so
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("building the pypto calculator needs cmake on PATH")
    import importlib.util
    spec = importlib.util.find_spec("pypto")  # locate without importing (import costs 3 s)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pypto is not installed")
    src = Path(list(spec.submodule_search_locations)[0]) / "lib" / "calculator"
    version, torch_root, abi = _torch_facts()
    work = so.parents[1].parent
    build, install = work / "build", work / "install"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    cmds = [
        f"{cmake} -S {src} -B {build} -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX={install} "
        f"-DPY3_MOD_TORCH_VERSION={version} -DPY3_MOD_TORCH_ROOT_PATH={torch_root} "
        f"-DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={abi}",
        f"{cmake} --build {build} -j {jobs}",
        f"{cmake} --install {build} --prefix {install}",
    ]
    out = log or subprocess.DEVNULL
    for cmd in cmds:
        r = subprocess.run(shlex.split(cmd), stdout=out, stderr=subprocess.STDOUT if log else out)
        if r.returncode:
            raise RuntimeError(f"calculator build failed (rc={r.returncode}): {cmd}")
    if not so.exists():
        raise RuntimeError(f"calculator build finished but {so} is missing")
    shutil.rmtree(build, ignore_errors=True)
    return so


def load_calculator(so: Path) -> None:
    """Load the kept calculator and tell pypto it is loaded, so it does not rebuild it (call after import pypto)."""
    ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
    from pypto._utils import BuildOnlineManager
    BuildOnlineManager().calculator_loaded = True


if __name__ == "__main__":  # python -m dsv41.kernels.pypto.env build  (prebuild the calculator)
    if sys.argv[1:] == ["build"]:
        print(build_calculator(run_dir(), log=sys.stdout))
