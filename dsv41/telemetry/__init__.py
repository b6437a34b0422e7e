"""Telemetry: what a run records. Spans of every submission and node, HBM per card (kept with
``plan.hbm``'s ledger), trace exports under ``traces/``, and a planned step (``dsv41.plan``) drawn
as spans. ``spans`` is the only module that imports OpenTelemetry."""
