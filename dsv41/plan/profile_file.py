"""An operator's own device profile from a JSON or TOML file (``--device-profile FILE``).

The file names the same constants as ``DeviceProfile`` (see ``docs/plan-validation.md`` for an
example). With ``base = "<built-in profile>"`` it overrides only what it gives, field by field (a
link table merges key by key); without one every constant is required. Every value is checked
against a plausible range and a bad one is refused with the field's dotted name and the range, so a
calibration file cannot silently produce a nonsense plan. ``sources`` (optional) says where the
operator's numbers come from; a constant the file sets without a source is cited as the file.
``weight_use_ns`` (optional, by checkpoint format fp8/fp4/bf16/f32) is for parts whose kernels
decode weights on every use, and ``shared_cores`` (optional) for cards that share a host's cores,
as this CPU's do. ``operators`` (optional) is the per-operator table (``dsv41.plan.operators``):
node kind -> a list of measured points ``{calls, bytes, flops, values, us, shape, source}``; the fit
between them is made on loading. ``profile_dict`` writes a profile back in this format (a file
round-trips).
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from dataclasses import replace

from dsv41.kernels.kinds import KINDS
from dsv41.plan.operators import Point, fit_all
from dsv41.plan.primitives import AlphaBeta, ByRanks
from dsv41.plan.profiles import CONSTANTS, PROFILES, DeviceProfile, Link

_US = (0.0, 1e7)      # up to 10 s: a CPU step on a loaded 2-core machine takes seconds
_SCALARS = {                       # field -> (low, high, integer)
    "hbm_bytes": (1e9, 1e13, False), "hbm_bytes_per_s": (1e10, 1e14, False), "cards_per_node": (1, 1024, True),
    "launch_us": (*_US, False), "host_launch_us": (*_US, False), "graph_launch_us": (*_US, False),
    "host_step_us": (*_US, False), "token_sync_us": (*_US, False),
}
_OPTIONAL = {"shared_cores": (0, 4096, True)}     # a profile without it: every card its own device
_RATES = ("mx", "dense", "vector")
_CLASSES = ("matmul", "gather", "vector")
_LINK_KEYS = ("bytes_per_s", "efficiency", "collective", "a2a")
_FORMATS = ("fp8", "fp4", "bf16", "f32")
_TOP = {"base", "name", "description", "sources", "flops_per_s", "efficiency", "intra", "inter", "weight_use_ns",
        "operators", *_SCALARS, *_OPTIONAL}
_OPTIONAL_TABLES = ("weight_use_ns", "shared_cores")    # absent from a file: none
_POINT = {"calls": (1e-3, 1e9), "bytes": (0.0, 1e15), "flops": (0.0, 1e18), "values": (0.0, 1e15),
          "us": (0.0, 1e9)}


class _Check:
    def __init__(self, path):
        self.path = path

    def fail(self, name: str, rule: str, got) -> ValueError:
        return ValueError(f"--device-profile {self.path}: {name}: {rule}, got {got!r}")

    def number(self, name: str, v, lo: float, hi: float, integer: bool = False, open_low: bool = False):
        kind = int if integer else (int, float)
        ok = isinstance(v, kind) and not isinstance(v, bool) and (lo < v if open_low else lo <= v) and v <= hi
        if not ok:
            what = "an integer" if integer else "a number"
            raise self.fail(name, f"must be {what} in {'(' if open_low else '['}{lo:g}, {hi:g}]", v)
        return v

    def table(self, name: str, v, keys, required: bool = True) -> dict:
        if not isinstance(v, dict):
            raise self.fail(name, f"must be a table with keys {list(keys)}", v)
        extra = set(v) - set(keys)
        if extra:
            raise self.fail(name, f"unknown keys {sorted(extra)}; allowed {list(keys)}", v)
        missing = [k for k in keys if k not in v]
        if required and missing:
            raise self.fail(name, f"missing keys {missing}", v)
        return v


def _read(path: Path) -> dict:
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ValueError(f"--device-profile {path}: cannot read ({e.strerror})") from None
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text.decode())
        if path.suffix == ".json":
            return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"--device-profile {path}: not valid {path.suffix[1:].upper()}: {e}") from None
    raise ValueError(f"--device-profile {path}: must end in .json or .toml, or name a built-in profile "
                     f"{sorted(PROFILES)}")


def _alpha_beta(chk: _Check, name: str, v) -> AlphaBeta:
    chk.table(name, v, ("alpha_us", "bytes_per_s"))
    return AlphaBeta(float(chk.number(f"{name}.alpha_us", v["alpha_us"], 0.0, 1e4)),
                     float(chk.number(f"{name}.bytes_per_s", v["bytes_per_s"], 1e8, 1e14)))


def _link(chk: _Check, name: str, v, base: Link | None) -> Link:
    chk.table(name, v, _LINK_KEYS, required=base is None)
    peak = chk.number(f"{name}.bytes_per_s", v["bytes_per_s"], 1e8, 1e14) if "bytes_per_s" in v else base.bytes_per_s
    eff = (chk.number(f"{name}.efficiency", v["efficiency"], 0.0, 1.0, open_low=True)
           if "efficiency" in v else base.efficiency)
    coll = _alpha_beta(chk, f"{name}.collective", v["collective"]) if "collective" in v else base.collective
    if "a2a" not in v:
        return Link(float(peak), float(eff), coll, base.a2a)
    rows = v["a2a"]
    if not isinstance(rows, list) or not rows:
        raise chk.fail(f"{name}.a2a", "must be a non-empty list of {ranks, alpha_us, bytes_per_s}", rows)
    fits = []
    for i, row in enumerate(rows):
        chk.table(f"{name}.a2a[{i}]", row, ("ranks", "alpha_us", "bytes_per_s"))
        ranks = chk.number(f"{name}.a2a[{i}].ranks", row["ranks"], 2, 4096, integer=True)
        if fits and ranks <= fits[-1][0]:
            raise chk.fail(f"{name}.a2a[{i}].ranks", f"must ascend (greater than {fits[-1][0]})", ranks)
        fits.append((ranks, _alpha_beta(chk, f"{name}.a2a[{i}]", {k: row[k] for k in ("alpha_us", "bytes_per_s")})))
    return Link(float(peak), float(eff), coll, ByRanks(tuple(fits)))


def load_profile(path) -> DeviceProfile:
    """A ``DeviceProfile`` from a JSON or TOML file, validated field by field."""
    path = Path(path)
    chk = _Check(path)
    raw = _read(path)
    chk.table("(top level)", raw, sorted(_TOP), required=False)
    base = None
    if "base" in raw:
        if raw["base"] not in PROFILES:
            raise chk.fail("base", f"must be one of {sorted(PROFILES)}", raw["base"])
        base = PROFILES[raw["base"]]
    given = {k for k in raw if k in CONSTANTS}
    if base is None:
        missing = [k for k in ("name", *CONSTANTS) if k not in raw]
        if missing:
            raise chk.fail("(top level)", f"missing {missing} (or give base = one of {sorted(PROFILES)})", sorted(raw))
    name = raw.get("name", f"{base.name}+{path.stem}" if base else None)
    if not isinstance(name, str) or not name:
        raise chk.fail("name", "must be a non-empty string", name)
    values = {}
    for k, (lo, hi, integer) in _SCALARS.items():
        values[k] = chk.number(k, raw[k], lo, hi, integer) if k in raw else getattr(base, k)
    rates = dict(base.flops_per_s) if base else {}
    if "flops_per_s" in raw:
        for k, v in chk.table("flops_per_s", raw["flops_per_s"], _RATES, required=base is None).items():
            rates[k] = float(chk.number(f"flops_per_s.{k}", v, 1e9, 1e17))
    eff = dict(base.efficiency) if base else {}
    if "efficiency" in raw:
        for k, v in chk.table("efficiency", raw["efficiency"], _CLASSES, required=base is None).items():
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise chk.fail(f"efficiency.{k}", "must be [fraction of HBM bandwidth, fraction of the FLOP rate]", v)
            eff[k] = tuple(float(chk.number(f"efficiency.{k}[{i}]", f, 0.0, 1.0, open_low=True))
                           for i, f in enumerate(v))
    for k, (lo, hi, integer) in _OPTIONAL.items():
        values[k] = chk.number(k, raw[k], lo, hi, integer) if k in raw else getattr(base, k) if base else 0
    decode = dict(base.weight_use_ns) if base else {}
    if "weight_use_ns" in raw:
        for k, v in chk.table("weight_use_ns", raw["weight_use_ns"], _FORMATS, required=False).items():
            decode[k] = float(chk.number(f"weight_use_ns.{k}", v, 0.0, 1e6))
    links = {k: _link(chk, k, raw[k], getattr(base, k) if base else None) if k in raw else getattr(base, k)
             for k in ("intra", "inter")}
    notes = raw.get("sources", {})
    if not isinstance(notes, dict) or not all(isinstance(v, str) for v in notes.values()):
        raise chk.fail("sources", "must be a table of constant -> text", notes)
    chk.table("sources", notes, (*CONSTANTS, "weight_use_ns", *_OPTIONAL), required=False)
    sources = dict(base.sources) if base else {}
    sources.update({k: notes.get(k, f"user profile file {path}") for k in given | ({"weight_use_ns", *_OPTIONAL} & set(raw))})
    dev = DeviceProfile(name, raw.get("description", f"user profile from {path}"), float(values["hbm_bytes"]),
                        float(values["hbm_bytes_per_s"]), rates, eff, links["intra"], links["inter"],
                        int(values["cards_per_node"]), float(values["launch_us"]), float(values["host_launch_us"]),
                        float(values["graph_launch_us"]), float(values["host_step_us"]),
                        float(values["token_sync_us"]), sources, decode, int(values["shared_cores"]))
    points = {k: op.points for k, op in base.operators.items()} if base else {}
    points.update(_operators(chk, raw.get("operators", {})))
    return replace(dev, operators=fit_all(points, dev))


def _operators(chk: _Check, v) -> dict[str, tuple[Point, ...]]:
    """Node kind -> its measured points, each field checked."""
    if not isinstance(v, dict):
        raise chk.fail("operators", "must be a table of node kind -> list of measured points", v)
    out = {}
    for kind, rows in v.items():
        if kind not in KINDS:
            raise chk.fail(f"operators.{kind}", f"unknown node kind; allowed {sorted(KINDS)}", kind)
        if not isinstance(rows, list) or not rows:
            raise chk.fail(f"operators.{kind}", "must be a non-empty list of {calls, bytes, flops, values, us, "
                                                "shape, source}", rows)
        pts = []
        for i, row in enumerate(rows):
            name = f"operators.{kind}[{i}]"
            chk.table(name, row, (*_POINT, "shape", "source"))
            nums = {f: float(chk.number(f"{name}.{f}", row[f], lo, hi)) for f, (lo, hi) in _POINT.items()}
            for f in ("shape", "source"):
                if not isinstance(row[f], str) or not row[f].strip():
                    raise chk.fail(f"{name}.{f}", "must be a non-empty string", row[f])
            if nums["us"] <= 0:
                raise chk.fail(f"{name}.us", "must be a number in (0, 1e+09]", row["us"])
            pts.append(Point(**nums, shape=row["shape"], source=row["source"]))
        out[kind] = tuple(pts)
    return out


def profile_dict(dev: DeviceProfile, base: str | None = None) -> dict:
    """The profile as a file's table (``load_profile`` reads it back to an equal profile): with
    ``base``, the constants that differ from that built-in profile, else every one."""
    ref = PROFILES[base] if base else None

    def link(k: Link) -> dict:
        return {"bytes_per_s": k.bytes_per_s, "efficiency": k.efficiency,
                "collective": {"alpha_us": k.collective.alpha_us, "bytes_per_s": k.collective.bytes_per_s},
                "a2a": [{"ranks": r, "alpha_us": ab.alpha_us, "bytes_per_s": ab.bytes_per_s} for r, ab in k.a2a.fits]}

    full = {"hbm_bytes": dev.hbm_bytes, "hbm_bytes_per_s": dev.hbm_bytes_per_s, "flops_per_s": dict(dev.flops_per_s),
            "efficiency": {k: list(v) for k, v in dev.efficiency.items()}, "intra": link(dev.intra),
            "inter": link(dev.inter), "cards_per_node": dev.cards_per_node, "launch_us": dev.launch_us,
            "host_launch_us": dev.host_launch_us, "graph_launch_us": dev.graph_launch_us,
            "host_step_us": dev.host_step_us, "token_sync_us": dev.token_sync_us,
            "weight_use_ns": dict(dev.weight_use_ns), "shared_cores": dev.shared_cores}
    out = {**({"base": base} if base else {}), "name": dev.name, "description": dev.description}
    for k, v in full.items():
        if (getattr(ref, k) != getattr(dev, k)) if ref else (v or k not in _OPTIONAL_TABLES):
            out[k] = v
    out["sources"] = {k: dev.sources[k] for k in out if k in dev.sources}
    own = {k: op for k, op in dev.operators.items() if ref is None or ref.operators.get(k) != op}
    out["operators"] = {k: [{"calls": p.calls, "bytes": p.bytes, "flops": p.flops, "values": p.values, "us": p.us,
                             "shape": p.shape, "source": p.source} for p in op.points] for k, op in own.items()}
    return out
