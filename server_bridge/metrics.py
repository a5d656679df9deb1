"""The bridge's counters, per tenant where one is known, and their Prometheus text form.

A counter is a dotted name (`evt.forwarded`, `refused.bad_token`, `evt.deferred.queue`)
and, optionally, the tenant it is about. Counters only go up and never wrap: each stops
at 2**63 - 1, which no honest stream reaches, so a hostile one (a forged gap report,
say) cannot make a rate go negative in a dashboard. The export is Prometheus's text
format: each name becomes `wren_<name with _ for .>_total`, labelled with its tenant when
it has one. Until the bridge serves HTTP, the service writes it to a file that
Prometheus's node_exporter textfile collector (or `wren bridge --stats`) reads.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["MAX_COUNT", "Counters", "prometheus_text", "write_text_file"]

MAX_COUNT = 2**63 - 1
_NOT_IN_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


class Counters:
    """Thread-safe, saturating counters keyed by (name, tenant or None)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str | None], int] = {}

    def add(self, name: str, n: int = 1, tenant: str | None = None) -> None:
        if n <= 0:
            return
        key = (name, tenant)
        with self._lock:
            self._values[key] = min(self._values.get(key, 0) + n, MAX_COUNT)

    def get(self, name: str, tenant: str | None = None) -> int:
        with self._lock:
            return self._values.get((name, tenant), 0)

    def totals(self) -> dict[str, int]:
        """Each name summed over its tenants (and the part no tenant is known for)."""
        out: dict[str, int] = {}
        with self._lock:
            for (name, _), value in self._values.items():
                out[name] = min(out.get(name, 0) + value, MAX_COUNT)
        return out

    def snapshot(self) -> dict[tuple[str, str | None], int]:
        with self._lock:
            return dict(self._values)


def _metric(name: str) -> str:
    return "wren_" + _NOT_IN_A_NAME.sub("_", name) + "_total"


def _label(value: str) -> str:
    # Tenant ids are [a-z0-9_-]; escaped anyway, as the format asks.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(
    counters: Mapping[tuple[str, str | None], int],
    gauges: Iterable[tuple[str, int | float, str]] = (),
) -> str:
    """Prometheus text exposition of `counters` ((name, tenant) -> value) and of
    `gauges` ((name, value, help)), sorted so two exports diff cleanly."""
    by_metric: dict[str, list[tuple[str | None, int]]] = {}
    for (name, tenant), value in counters.items():
        by_metric.setdefault(_metric(name), []).append((tenant, value))
    lines: list[str] = []
    for metric in sorted(by_metric):
        lines.append(f"# TYPE {metric} counter")
        for tenant, value in sorted(by_metric[metric], key=lambda tv: tv[0] or ""):
            labels = "" if tenant is None else f'{{tenant="{_label(tenant)}"}}'
            lines.append(f"{metric}{labels} {value}")
    for name, level, help_text in sorted(gauges):
        metric = "wren_" + _NOT_IN_A_NAME.sub("_", name)
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge", f"{metric} {level}"]
    return "\n".join(lines) + "\n"


def write_text_file(path: str | os.PathLike[str], text: str) -> None:
    """Replace `path` with `text` so a reader never sees half an export (node_exporter
    reads these files while we write them)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
