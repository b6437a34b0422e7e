"""The import graph of ``dsv41/``: no circles, and nothing imported upward from ``cpu/``, ``ops/`` or ``graph/``.

The graph is read from the source with ``ast`` (every ``import``/``from ... import`` anywhere in a
module, function-level and relative ones included), so it sees imports that only run on some paths.
``python tests/test_imports.py`` prints the module and package cycles it finds.
"""
from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent / "dsv41"
OWNED = ("dsv41.cli", "dsv41.telemetry", "dsv41.plan")     # packages whose circles must be gone now
LOWER = ("dsv41.cpu", "dsv41.ops", "dsv41.graph")
# ``python -m`` entry points kept at their old paths: each only imports its command's main from cli/,
# and nothing imports them (checked below), so they close no circle; the package graph leaves them out
# (``dsv41.checkpoint.write`` would otherwise read as checkpoint -> cli).
SHIMS = ("dsv41.run", "dsv41.replay", "dsv41.checkpoint.write")
UPPER = ("dsv41.cli", "dsv41.cluster", "dsv41.telemetry", "dsv41.plan", "dsv41.checkpoint", "dsv41.engine",
         "dsv41.kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` (a module or a module's attribute) lies in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(mod: str, path: Path, known: set[str]) -> set[str]:
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule pkg.sub; ``from mod import name`` the module
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for n in names:
            target = _resolve(n, known)
            if target and target.startswith("dsv41") and target != mod:
                found.add(target)
    return found


def module_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph = {m: imports_of(m, p, known) for m, p in mods.items()}
    for m in graph:    # a package's __init__ is not an edge of its own modules' imports of siblings
        graph[m].discard("dsv41")
    return graph


def package_of(mod: str) -> str:
    """The first level under dsv41 (``dsv41.cli.run`` -> ``dsv41.cli``; ``dsv41.serving`` itself)."""
    return ".".join(mod.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if m in SHIMS:
            continue
        a = package_of(m)
        out.setdefault(a, set())
        out[a] |= {package_of(d) for d in deps if package_of(d) != a}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _in(mod: str, packages) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def test_the_graph_sees_known_edges():
    """The reader itself: a module-level, a function-level and a relative-free ``from pkg import mod``."""
    g = module_graph()
    assert "dsv41.config" in g["dsv41.cli.args"]
    assert "dsv41.cli.budget" in g["dsv41.cli.args"]          # function-level import in _budget
    assert "dsv41.cli.trace" in g["dsv41.cli.run"]            # from dsv41.cli import trace


def test_entry_points_are_shims_nobody_imports():
    g, mods = module_graph(), modules()
    assert {m for m, deps in g.items() if deps & set(SHIMS)} == set()
    for shim in SHIMS:
        assert all(d.startswith("dsv41.cli.") for d in g[shim]), shim
        body = ast.parse(mods[shim].read_text()).body
        assert len(body) <= 3, f"{shim}: an entry point holds no logic"


def test_no_module_cycle_in_owned_packages():
    found = [c for c in cycles(module_graph()) if any(_in(m, OWNED) for m in c)]
    assert found == []


def test_no_package_cycle_through_owned_packages():
    found = [c for c in cycles(package_graph(module_graph())) if any(_in(p, OWNED) for p in c)]
    assert found == []


def test_no_cycle_anywhere():
    g = module_graph()
    assert cycles(g) == []
    assert cycles(package_graph(g)) == []


def _upward(packages, above) -> dict[str, list[str]]:
    found = {m: sorted(d for d in deps if _in(d, above)) for m, deps in module_graph().items() if _in(m, packages)}
    return {m: d for m, d in found.items() if d}


def test_ops_and_graph_import_nothing_from_the_command_line_or_the_runtime():
    assert _upward(LOWER, ("dsv41.cli", "dsv41.cluster", "dsv41.telemetry", "dsv41.plan")) == {}


def test_graph_imports_nothing_above_it():
    assert _upward(("dsv41.graph",), UPPER) == {}


def test_ops_imports_nothing_above_it():
    """The goldens are the floor: not even the model's blocks, the graph or the weights' drawing."""
    assert _upward(("dsv41.ops",), UPPER + ("dsv41.model", "dsv41.graph", "dsv41.weights")) == {}


def test_cpu_kernels_import_nothing_from_dsv41_above_them():
    """How the CPU runs a stage is below the stage math: ``cpu/`` imports only ``cpu/`` and the safe
    file writer (``dsv41.outputs``, the standard library's alone)."""
    others = tuple(p for p in modules() if p not in ("dsv41", "dsv41.outputs") and not _in(p, ("dsv41.cpu",)))
    assert _upward(("dsv41.cpu",), others) == {}


if __name__ == "__main__":
    g = module_graph()
    print("module cycles:", *cycles(g), sep="\n  ")
    pg = package_graph(g)
    print("package cycles:", *cycles(pg), sep="\n  ")
    print("package edges:", *(f"{p} -> {sorted(d)}" for p, d in sorted(pg.items())), sep="\n  ")
