"""Prometheus metrics for prefixd: collectors, the engine observer that feeds them, the exporter.

Everything lives on a private `CollectorRegistry` owned by one `Metrics` object; nothing is
registered globally, so tests and several daemons in one process never collide.
"""

from __future__ import annotations

from prefixd.metrics.collectors import Metrics
from prefixd.metrics.exporter import MetricsExporter, parse_metrics_addr
from prefixd.metrics.observer import MetricsObserver

__all__ = ["Metrics", "MetricsExporter", "MetricsObserver", "parse_metrics_addr"]
