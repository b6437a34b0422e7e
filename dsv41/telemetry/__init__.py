"""Telemetry: spans of every submission and node, HBM accounting per card, trace exports under
``traces/``, a roofline latency model and the FLASH-scale plan. ``spans`` is the only module that
imports OpenTelemetry."""
