"""Write a graph as DOT, or as SVG when graphviz's ``dot`` is installed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from dsv41.outputs import open_output


def write_graph(graph, path: str) -> Path:
    path = Path(path)
    dot = graph.to_dot()
    if path.suffix == ".svg":
        exe = shutil.which("dot")
        if exe is None:
            raise ValueError("--show-graph: an .svg needs graphviz's 'dot' on PATH; use a .dot path instead")
        svg = subprocess.run([exe, "-Tsvg"], input=dot.encode(), capture_output=True, check=True).stdout
        with open_output(path, binary=True) as f:
            f.write(svg)
    else:
        with open_output(path) as f:
            f.write(dot)
    return path
