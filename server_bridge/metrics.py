"""The bridge's counters and their Prometheus text form.

Counters are dotted names (`evt.forwarded`, `refused.bad_token`, `evt.deferred.device`);
one about a single tenant is named `tenant.<tenant>.<name>`, next to the bridge-wide
`<name>`. They only go up and never wrap: `add` stops each at 2**63 - 1, which no honest
stream reaches, so a hostile one cannot make a rate go negative in a dashboard. The
export is Prometheus's text format: each name becomes `wren_<name, _ for .>_total`, a
tenant's counter carrying a `tenant` label. The bridge service writes it to a file that
node_exporter's textfile collector, or `wren bridge --stats`, reads, and with
`--metrics HOST:PORT` serves it at /metrics too (metrics_http.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

__all__ = ["MAX_COUNT", "add", "prometheus_text", "write_text_file"]

MAX_COUNT = 2**63 - 1
_NOT_IN_A_NAME = re.compile(r"[^a-zA-Z0-9_]")
_TENANT = "tenant."


def add(counters: MutableMapping[str, int], name: str, n: int = 1) -> None:
    """counters[name] += n, saturating at MAX_COUNT; the caller holds the lock."""
    if n > 0:
        counters[name] = min(counters.get(name, 0) + n, MAX_COUNT)


def _split(name: str) -> tuple[str, str | None]:
    # `tenant.<id>.<name>`: tenant ids are [a-z0-9_-], so the id ends at the next dot.
    if name.startswith(_TENANT):
        tenant, dot, rest = name[len(_TENANT) :].partition(".")
        if dot and tenant and rest:
            return rest, tenant
    return name, None


def _metric(name: str) -> str:
    return "wren_" + _NOT_IN_A_NAME.sub("_", name)


def _label(value: str) -> str:
    # Tenant ids never need it; escaped anyway, as the format asks.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(
    counters: Mapping[str, int], gauges: Iterable[tuple[str, int | float, str]] = ()
) -> str:
    """Prometheus text exposition of `counters` and of `gauges` ((name, value, help)),
    sorted so that two exports diff cleanly."""
    by_metric: dict[str, list[tuple[str | None, int]]] = {}
    for full, value in counters.items():
        name, tenant = _split(full)
        by_metric.setdefault(_metric(name) + "_total", []).append((tenant, value))
    lines: list[str] = []
    for metric in sorted(by_metric):
        lines.append(f"# TYPE {metric} counter")
        for tenant, value in sorted(by_metric[metric], key=lambda tv: tv[0] or ""):
            labels = "" if tenant is None else f'{{tenant="{_label(tenant)}"}}'
            lines.append(f"{metric}{labels} {value}")
    for name, level, help_text in sorted(gauges):
        metric = _metric(name)
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge", f"{metric} {level}"]
    return "\n".join(lines) + "\n"


def write_text_file(path: str | os.PathLike[str], text: str) -> None:
    """Replace `path` with `text` so a reader never sees half an export (node_exporter
    reads these files while they are written)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
