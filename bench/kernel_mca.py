"""What LLVM's machine-code analyser predicts for a weight kernel's inner loop: cycles per 32-value
block and weight row, and the busiest execution ports, for this CPU or another LLVM CPU model.

    python bench/kernel_mca.py [--mcpu znver3] [--kernels fp4:1:1:table,fp8:1:2:prescaled]

Each kernel (format:activation rows:weight rows:decode) is compiled as ``cpu.fused_product``
compiles it for the host (the 8-lane table decode where the host has no AVX-512), its block loop
cut out of the assembly and run through ``llvm-mca`` (it must be on PATH: Debian's ``llvm``
package). A prediction, not a measurement: it takes every load from L1 and knows nothing of
memory; it showed which ports bound the AVX2 decode (issue 29, docs/flash-shapes.md).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile

import llvmlite.binding as llvm

from dsv41.cpu import fused_product as fp

DEFAULT = "fp8:1:1:prescaled,fp8:4:1:prescaled,fp4:1:1:table,fp4:4:1:table,bf16:1:2:widen,bf16:4:1:widen"


def block_loop(fmt: str, rows: int, weight_rows: int, variant: str) -> str:
    """The assembly of the kernel's loop over blocks: the basic block with the most FMAs, up to its
    jump back."""
    width = fp.permute_width()
    mod, tm = fp.optimised(fp.kernel_ir(fmt, rows, weight_rows, variant, width, halves=fp.half_sweeps(rows, width)))
    blocks = tm.emit_assembly(mod).split("\n.LBB")
    body = max(blocks, key=lambda b: b.count("vfmadd"))
    lines = []
    for line in body.splitlines()[1:]:
        if line.startswith("\t") and not line.startswith("\t."):
            lines.append(line)
            if line.lstrip().startswith("j"):
                break
    return "\n".join(lines) + "\n"


def analyse(asm: str, mcpu: str, iterations: int = 200) -> tuple[float, int, list[tuple[str, float]]]:
    """(cycles per loop iteration, FMAs per iteration, the three busiest resources and their
    pressure per iteration)."""
    with tempfile.NamedTemporaryFile("w", suffix=".s") as f:
        f.write(asm)
        f.flush()
        out = subprocess.run(["llvm-mca", f"-mcpu={mcpu}", f"-iterations={iterations}", "-resource-pressure",
                              "-instruction-info=false", f.name], capture_output=True, text=True, check=True).stdout
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", out).group(1)) / iterations
    # a resource with several units is listed once per unit: [12.0] and [12.1] both Zn3FPP45
    names = {k: n + (f"[{k.split('.')[1]}]" if "." in k else "")
             for k, n in re.findall(r"^\[(\d+(?:\.\d+)?)\]\s+-\s+(\S+)", out, re.M)}
    head, values = out.split("Resource pressure per iteration:\n")[1].splitlines()[:2]
    keys = re.findall(r"\[(\d+(?:\.\d+)?)\]", head)
    pressure = sorted(((names.get(k, k), float(v)) for k, v in zip(keys, values.split()) if v != "-"),
                      key=lambda kv: -kv[1])
    return cycles, asm.count("vfmadd"), pressure[:3]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mcpu", default=llvm.get_host_cpu_name(), help="LLVM CPU model for llvm-mca (default: this one)")
    p.add_argument("--kernels", default=DEFAULT, help="format:rows:weight rows:decode, comma-separated")
    a = p.parse_args(argv)
    if shutil.which("llvm-mca") is None:
        p.error("llvm-mca is not on PATH (Debian: apt install llvm)")
    print(f"llvm-mca -mcpu={a.mcpu}; the host's kernels ({fp.permute_width()}-lane table decode)")
    for spec in a.kernels.split(","):
        fmt, rows, weight_rows, variant = spec.split(":")
        rows, weight_rows = int(rows), int(weight_rows)
        cycles, fmas, busiest = analyse(block_loop(fmt, rows, weight_rows, variant), a.mcpu)
        # an FMA covers 8 lanes (AVX2) or 16 (AVX-512); a block-row is 32 values of one weight row, one x row
        block_rows = fmas * (16 if fp.permute_width() == 16 else 8) / 32 / rows
        print(f"  {spec:<22} {cycles / block_rows:6.2f} cycles per block and weight row "
              f"({cycles / block_rows / rows:5.2f} per x row); busiest: "
              + ", ".join(f"{n} {v:.1f}" for n, v in busiest) + " per iteration")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
