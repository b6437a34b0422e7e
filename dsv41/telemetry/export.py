"""Span records -> files under ``traces/``.

- ``NAME.otlp.jsonl``: OTLP JSON, one ``ExportTraceServiceRequest`` per line (one line per trace,
  i.e. per step), encoded by the OTLP exporter's own encoder (``spans.otlp_json_lines``): ids in hex,
  times in unix nanoseconds as decimal strings, 64-bit integers as strings (proto3 JSON).
- ``NAME.perfetto.json``: Chrome trace-event JSON for Perfetto / chrome://tracing: one process per card
  (plus one for the engine's step spans), one track per stream (submissions, compute, comm), ``X``
  events for spans and a ``C`` counter of the card's HBM live bytes at every node's end.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from dsv41.outputs import open_output
from dsv41.plan.roofline import STREAMS, stream
from dsv41.telemetry.spans import otlp_json_lines

TRACES = Path("traces")


def write_otlp(records: list[dict], resource: dict, path: Path) -> Path:
    with open_output(path) as f:
        for line in otlp_json_lines(records, resource):
            f.write(line + "\n")
    return path


def _track(r: dict) -> str:
    kind = r["attributes"].get("dsv41.span")
    return "submissions" if kind == "submission" else stream(r["attributes"].get("dsv41.kernel", ""))


def perfetto_events(records: list[dict]) -> list[dict]:
    """Trace events; overlapping spans of one (card, track) get extra lanes so slices stay nested."""
    base = min((r["start_ns"] for r in records), default=0)
    cards = sorted({r["attributes"]["dsv41.card"] for r in records if "dsv41.card" in r["attributes"]})
    engine = (max(cards) + 1) if cards else 0
    tracks = ["submissions", *STREAMS]
    lanes: dict[tuple, list[int]] = defaultdict(list)   # (pid, track) -> each lane's last end, ns
    events = [{"ph": "M", "name": "process_name", "pid": c, "args": {"name": f"card {c}"}} for c in cards]
    events += [{"ph": "M", "name": "process_sort_index", "pid": c, "args": {"sort_index": c}} for c in cards]
    events.append({"ph": "M", "name": "process_name", "pid": engine, "args": {"name": "engine"}})
    named = set()
    for r in records:
        a = r["attributes"]
        ts, dur = (r["start_ns"] - base) / 1e3, (r["end_ns"] - r["start_ns"]) / 1e3
        if a.get("dsv41.span") == "step" or "dsv41.card" not in a:
            pid, track = engine, "steps"
        else:
            pid, track = a["dsv41.card"], _track(r)
        busy = lanes[(pid, track)]
        lane = next((i for i, end in enumerate(busy) if end <= r["start_ns"]), len(busy))
        busy[lane:lane + 1] = [r["end_ns"]]
        tid = (tracks.index(track) if track in tracks else 0) * 100 + lane
        if (pid, tid) not in named:
            named.add((pid, tid))
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": track if not lane else f"{track} #{lane + 1}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        events.append({"ph": "X", "name": r["name"], "cat": a.get("dsv41.kernel", a.get("dsv41.span", "")),
                       "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": a})
        if a.get("dsv41.span") == "node":
            events.append({"ph": "C", "name": "hbm", "pid": pid, "ts": ts + dur,
                           "args": {"live_bytes": a["dsv41.hbm.live_bytes"]}})
    return events


def write_perfetto(records: list[dict], path: Path) -> Path:
    base = min((r["start_ns"] for r in records), default=0)
    doc = {"traceEvents": perfetto_events(records), "displayTimeUnit": "ms",
           "otherData": {"start_unix_ns": base}}
    with open_output(path) as f:
        f.write(json.dumps(doc, separators=(",", ":")))
    return path


def write_traces(name: str, records: list[dict], resource: dict, folder: Path = TRACES) -> dict[str, str]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return {"otlp": str(write_otlp(records, resource, folder / f"{name}.otlp.jsonl")),
            "perfetto": str(write_perfetto(records, folder / f"{name}.perfetto.json"))}
