"""The bridge's counters: per tenant, saturating, and their Prometheus text form."""

from __future__ import annotations

import threading
from pathlib import Path

from server_bridge.metrics import MAX_COUNT, Counters, prometheus_text, write_text_file


def test_counters_per_tenant_and_their_totals() -> None:
    c = Counters()
    c.add("evt.forwarded", 3, tenant="demo")
    c.add("evt.forwarded", 2, tenant="other")
    c.add("evt.forwarded")
    c.add("refused.bad_token", tenant="demo")
    c.add("evt.lost", 0)  # nothing counted, no row made
    assert c.get("evt.forwarded", "demo") == 3 and c.get("evt.forwarded") == 1
    assert c.totals() == {"evt.forwarded": 6, "refused.bad_token": 1}


def test_counters_saturate_instead_of_wrapping() -> None:
    c = Counters()
    c.add("evt.lost", MAX_COUNT - 1, tenant="demo")
    c.add("evt.lost", 2**64, tenant="demo")
    c.add("evt.lost", 5, tenant="other")
    assert c.get("evt.lost", "demo") == MAX_COUNT
    assert c.totals() == {"evt.lost": MAX_COUNT}


def test_counting_from_threads_loses_nothing() -> None:
    c = Counters()

    def work() -> None:
        for _ in range(5000):
            c.add("rx", tenant="demo")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get("rx", "demo") == 20000


def test_prometheus_text_is_the_exposition_format() -> None:
    c = Counters()
    c.add("evt.forwarded", 7, tenant="other")
    c.add("evt.forwarded", 3, tenant="demo")
    c.add("refused.bad_token", 1)
    text = prometheus_text(c.snapshot(), [("bridge.queued_bytes", 1024, "bytes held")])
    assert text == (
        "# TYPE wren_evt_forwarded_total counter\n"
        'wren_evt_forwarded_total{tenant="demo"} 3\n'
        'wren_evt_forwarded_total{tenant="other"} 7\n'
        "# TYPE wren_refused_bad_token_total counter\n"
        "wren_refused_bad_token_total 1\n"
        "# HELP wren_bridge_queued_bytes bytes held\n"
        "# TYPE wren_bridge_queued_bytes gauge\n"
        "wren_bridge_queued_bytes 1024\n"
    )


def test_the_text_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "bridge.prom"
    write_text_file(path, "wren_rx_total 1\n")
    write_text_file(path, "wren_rx_total 2\n")
    assert path.read_text() == "wren_rx_total 2\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["bridge.prom"]
