"""The bridge's counters: saturating, per tenant, and their Prometheus text form."""

from __future__ import annotations

from pathlib import Path

from server_bridge.metrics import MAX_COUNT, add, prometheus_text, write_text_file


def test_counters_saturate_instead_of_wrapping() -> None:
    c: dict[str, int] = {}
    add(c, "evt.lost", MAX_COUNT - 1)
    add(c, "evt.lost", 2**64)
    add(c, "evt.held", 0)  # nothing counted, no row made
    add(c, "evt.held", -3)
    assert c == {"evt.lost": MAX_COUNT}


def test_prometheus_text_labels_a_tenants_counters() -> None:
    stats = {
        "evt.forwarded": 10,
        "tenant.other.evt.forwarded": 7,
        "tenant.demo.evt.forwarded": 3,
        "refused.bad_token": 1,
        "tenant.demo.refused.bad_token": 1,
        "tenant.x": 2,  # not a tenant's counter: no name after the id
    }
    text = prometheus_text(stats, [("bridge.held_bytes", 1024, "bytes the bridge holds")])
    assert text == (
        "# TYPE wren_evt_forwarded_total counter\n"
        "wren_evt_forwarded_total 10\n"
        'wren_evt_forwarded_total{tenant="demo"} 3\n'
        'wren_evt_forwarded_total{tenant="other"} 7\n'
        "# TYPE wren_refused_bad_token_total counter\n"
        "wren_refused_bad_token_total 1\n"
        'wren_refused_bad_token_total{tenant="demo"} 1\n'
        "# TYPE wren_tenant_x_total counter\n"
        "wren_tenant_x_total 2\n"
        "# HELP wren_bridge_held_bytes bytes the bridge holds\n"
        "# TYPE wren_bridge_held_bytes gauge\n"
        "wren_bridge_held_bytes 1024\n"
    )


def test_the_text_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "bridge.prom"
    write_text_file(path, "wren_rx_total 1\n")
    write_text_file(path, "wren_rx_total 2\n")
    assert path.read_text() == "wren_rx_total 2\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["bridge.prom"]
