"""Append-only segments of msgpack records, one directory per tenant, indexed in memory.

A record is one event as hosts receive it: `[ts_ms, device, run, i, usr, conv,
payload]` (payload: the encoded envelope, as published), framed on disk as a 4-byte
length and a 4-byte CRC-32 of the body, both big-endian, then the body. Records go to
the tenant's current segment (`<root>/<tenant>/<n>.seg`, n counting up) until it holds
`segment_bytes`; then a new one starts. Nothing is ever rewritten.

Durability: each append is one `os.write` of the whole frame, so a crash of the process
loses nothing it appended (the kernel has it); a thread fsyncs every segment written
to since the last sync every `sync_s` (0.2 s by default), so a power cut loses at most
the events of the last 0.2 s. A torn last record (a power cut mid-write) fails its CRC
or its length at the next open: the segment is cut back to the last whole record, and
logging goes on after it.

The index is built at open by reading every segment once, and kept as appends come:
per tenant, the records of each run (device, run) by offset and id, and the runs of
each conversation in the order they began. "Events of run R after id X" and "runs of
conversation C" are then lookups and seeks, not scans. Retention drops whole segments,
oldest first, per tenant, by age (of a segment's last record) and by bytes; the
current segment is never dropped.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgpack

from server_bridge.topics import BadTopic, check_id

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SYNC_S",
    "MAX_RECORD_BYTES",
    "EventLog",
    "EventLogError",
    "LoggedEvent",
    "LoggedRun",
    "RecordTooLarge",
]

log = logging.getLogger("wren.bridge.eventlog")

#: A segment holds this much before the next one starts: retention's unit.
DEFAULT_SEGMENT_BYTES = 4 << 20
#: How often written segments are fsynced: the most a power cut loses.
DEFAULT_SYNC_S = 0.2
#: The largest record (an event is at most 16 KiB from a board, plus its fields).
MAX_RECORD_BYTES = 64 << 10
_FRAME = struct.Struct(">II")
_SUFFIX = ".seg"


class EventLogError(Exception):
    """The log refused an append or could not be read."""


class RecordTooLarge(EventLogError):
    """A record over MAX_RECORD_BYTES: refused, nothing written."""


@dataclass(frozen=True)
class LoggedEvent:
    ts_ms: int
    device: str
    run: str
    i: int
    usr: str | None
    conv: str | None
    payload: bytes


@dataclass(frozen=True)
class LoggedRun:
    """What the index knows of one run: its user and conversation (from its records;
    None when none named one), and the ids the log holds, lowest and highest."""

    usr: str | None
    conv: str | None
    first: int
    last: int
    count: int
    # When its first and latest records the log holds were appended (Unix ms).
    first_ms: int = 0
    last_ms: int = 0


@dataclass
class _Segment:
    n: int
    path: Path
    size: int = 0
    last_ts_ms: int = 0


@dataclass
class _Tenant:
    segments: list[_Segment] = field(default_factory=list)
    fd: int | None = None  # the current segment's, open for appending
    # (device, run) -> [(segment n, offset, event id)], in append order.
    runs: dict[tuple[str, str], list[tuple[int, int, int]]] = field(default_factory=dict)
    # conv -> (device, run) in the order their first events came (dict as ordered set).
    convs: dict[str, dict[tuple[str, str], None]] = field(default_factory=dict)
    # (device, run) -> [usr, conv], the first each of its records named.
    named: dict[tuple[str, str], list[str | None]] = field(default_factory=dict)
    # (device, run) -> [first, latest] append time of its records (Unix ms).
    times: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # conv -> where its latest record is (segment n, offset): the most recently active
    # conversations first (conversations()).
    conv_last: dict[str, tuple[int, int]] = field(default_factory=dict)
    dirty: bool = False


class EventLog:
    """One bridge's log (see the module docstring). Thread-safe."""

    def __init__(
        self,
        root: Path | str,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        sync_s: float = DEFAULT_SYNC_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if segment_bytes < MAX_RECORD_BYTES:
            raise ValueError(f"segment_bytes must be >= {MAX_RECORD_BYTES}")
        if sync_s <= 0:
            raise ValueError("sync_s must be > 0")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.sync_s = sync_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}
        self.syncs = 0  # fsync rounds that found something to sync (for tests, stats)
        self.truncated = 0  # bytes of torn records cut at open
        self._closed = False
        # Descriptors of segments that were current until a new one started: the sync
        # thread fsyncs and closes them.
        self._retired: list[int] = []
        # A directory whose name no tenant can have ("_turns") is not the log's.
        for d in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if not d.name.startswith("_"):
                self._open_tenant(d.name)
        self._stop = threading.Event()
        self._syncer = threading.Thread(target=self._sync_loop, name="wren-eventlog-sync",
                                        daemon=True)  # fmt: skip
        self._syncer.start()

    # ------------------------------------------------------------------ writing

    def append(
        self,
        tenant: str,
        device: str,
        run: str,
        i: int,
        payload: bytes,
        *,
        usr: str | None = None,
        conv: str | None = None,
        ts_ms: int | None = None,
    ) -> None:
        """Append one event (raises RecordTooLarge or EventLogError; nothing is written
        then)."""
        _check_tenant(tenant)
        ts = int(self._clock() * 1000) if ts_ms is None else ts_ms
        body = msgpack.packb([ts, device, run, i, usr, conv, bytes(payload)], use_bin_type=True)
        if len(body) > MAX_RECORD_BYTES:
            raise RecordTooLarge(
                f"an event record of {len(body):,} bytes: at most {MAX_RECORD_BYTES:,}"
            )
        frame = _FRAME.pack(len(body), zlib.crc32(body)) + body
        with self._lock:
            if self._closed:
                raise EventLogError("the event log is closed")
            ten = self._tenants.get(tenant) or self._open_tenant(tenant)
            seg = ten.segments[-1]
            if seg.size and seg.size + len(frame) > self.segment_bytes:
                seg = self._new_segment(tenant, ten)
            assert ten.fd is not None
            offset = seg.size
            written = os.write(ten.fd, frame)
            if written != len(frame):
                # A short write (a full disk): the partial record is cut at the next
                # open; the offset stays where it was so the next append overwrites
                # nothing it should not.
                raise EventLogError(f"the event log wrote {written} of {len(frame)} bytes")
            seg.size += len(frame)
            seg.last_ts_ms = max(seg.last_ts_ms, ts)
            ten.dirty = True
            self._index(ten, seg.n, offset, device, run, i, usr, conv, ts)

    # ------------------------------------------------------------------ reading

    def events(self, tenant: str, device: str, run: str, after: int = 0) -> list[LoggedEvent]:
        """The run's events with ids above `after`, in the order they were appended."""
        _check_tenant(tenant)
        with self._lock:
            ten = self._tenants.get(tenant)
            if ten is None:
                return []
            wanted = [(n, off) for n, off, i in ten.runs.get((device, run), ()) if i > after]
            paths = {s.n: s.path for s in ten.segments}
        out = []
        handles: dict[int, BinaryIO] = {}
        try:
            for n, off in wanted:
                f = handles.get(n)
                if f is None:
                    f = handles[n] = open(paths[n], "rb")  # noqa: SIM115 (closed below)
                f.seek(off)
                out.append(_read_record(f))
        finally:
            for f in handles.values():
                f.close()
        return out

    def run(self, tenant: str, device: str, run: str) -> LoggedRun | None:
        """What the log holds of a run, or None when it holds none of its events."""
        _check_tenant(tenant)
        with self._lock:
            ten = self._tenants.get(tenant)
            entries = ten.runs.get((device, run)) if ten is not None else None
            if not entries or ten is None:
                return None
            usr, conv = ten.named.get((device, run), (None, None))
            first_ms, last_ms = ten.times.get((device, run), (0, 0))
            ids = [e[2] for e in entries]
            return LoggedRun(usr, conv, min(ids), max(ids), len(ids), first_ms, last_ms)

    def conversations(
        self, tenant: str, usr: str | None = None
    ) -> list[tuple[str, list[tuple[str, str]]]]:
        """The tenant's conversations, the most recently active first, each with its
        (device, run) in the order they began; with `usr`, only that user's runs (and
        conversations with any)."""
        _check_tenant(tenant)
        with self._lock:
            ten = self._tenants.get(tenant)
            if ten is None:
                return []
            order = sorted(ten.conv_last, key=lambda c: ten.conv_last[c], reverse=True)
            out = []
            for conv in order:
                runs = [k for k in ten.convs.get(conv, ()) if k in ten.runs]
                if usr is not None:
                    runs = [k for k in runs if ten.named.get(k, [None])[0] == usr]
                if runs:
                    out.append((conv, runs))
            return out

    def runs_of(self, tenant: str, conv: str) -> list[tuple[str, str]]:
        """The (device, run) of a conversation, in the order their first events came."""
        _check_tenant(tenant)
        with self._lock:
            ten = self._tenants.get(tenant)
            return list(ten.convs.get(conv, ())) if ten is not None else []

    def tenants(self) -> list[str]:
        with self._lock:
            return list(self._tenants)

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            ten = self._tenants.get(tenant)
            return sum(s.size for s in ten.segments) if ten is not None else 0

    # ------------------------------------------------------------------ retention

    def retain(self, tenant: str, *, max_age_s: float | None = None,
               max_bytes: int | None = None) -> int:  # fmt: skip
        """Drop the tenant's oldest whole segments: those whose last event is older than
        `max_age_s`, then more until it holds at most `max_bytes`; never the current
        one. Returns how many segments went."""
        _check_tenant(tenant)
        now_ms = int(self._clock() * 1000)
        with self._lock:
            ten = self._tenants.get(tenant)
            if ten is None:
                return 0
            gone: list[_Segment] = []
            total = sum(s.size for s in ten.segments)
            for seg in ten.segments[:-1]:
                old = max_age_s is not None and now_ms - seg.last_ts_ms > max_age_s * 1000
                big = max_bytes is not None and total > max_bytes
                if not (old or big):
                    break
                gone.append(seg)
                total -= seg.size
            if not gone:
                return 0
            dropped = {s.n for s in gone}
            ten.segments = ten.segments[len(gone):]
            for key in list(ten.runs):
                kept = [e for e in ten.runs[key] if e[0] not in dropped]
                if kept:
                    ten.runs[key] = kept
                else:
                    del ten.runs[key]
                    ten.named.pop(key, None)
                    ten.times.pop(key, None)
            for conv in list(ten.convs):
                left = {k: None for k in ten.convs[conv] if k in ten.runs}
                if left:
                    ten.convs[conv] = left
                else:
                    del ten.convs[conv]
                    ten.conv_last.pop(conv, None)
            for seg in gone:
                seg.path.unlink(missing_ok=True)
        log.info("event log of tenant %s: dropped %d segment(s)", tenant, len(gone))
        return len(gone)

    # ------------------------------------------------------------------ lifecycle

    def sync(self) -> None:
        """fsync every segment written to since the last sync."""
        # Duplicates of the descriptors, taken under the lock and synced outside it: an
        # fsync takes milliseconds (tens on a busy disk), and appends, which the bridge
        # makes on its network thread, must not wait for it. A segment closed meanwhile
        # (rotation: fsynced as it closes) keeps its duplicate valid until synced.
        with self._lock:
            fds, self._retired = self._retired, []
            for ten in self._tenants.values():
                if ten.dirty and ten.fd is not None:
                    fds.append(os.dup(ten.fd))
                    ten.dirty = False
            if fds:
                self.syncs += 1
        for fd in fds:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        self._stop.set()
        self._syncer.join(timeout=5)
        self.sync()
        with self._lock:
            self._closed = True
            for ten in self._tenants.values():
                if ten.fd is not None:
                    os.close(ten.fd)
                    ten.fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.sync_s):
            try:
                self.sync()
            except OSError:
                log.exception("syncing the event log failed")

    # ------------------------------------------------------------------ inside

    def _open_tenant(self, tenant: str) -> _Tenant:
        """Read (and index) a tenant's segments, or start its first; the caller holds
        the lock or runs before any thread."""
        _check_tenant(tenant)
        d = self.root / tenant
        d.mkdir(exist_ok=True)
        ten = _Tenant()
        for path in sorted(d.glob(f"*{_SUFFIX}"), key=lambda p: int(p.stem)):
            seg = _Segment(int(path.stem), path)
            self._scan(ten, seg)
            ten.segments.append(seg)
        self._tenants[tenant] = ten
        if not ten.segments:
            self._new_segment(tenant, ten)
        else:
            ten.fd = os.open(ten.segments[-1].path, os.O_WRONLY | os.O_APPEND)
        return ten

    def _new_segment(self, tenant: str, ten: _Tenant) -> _Segment:
        n = ten.segments[-1].n + 1 if ten.segments else 1
        path = self.root / tenant / f"{n:010d}{_SUFFIX}"
        if ten.fd is not None:
            # Synced and closed by the sync thread, not here: this runs in an append.
            self._retired.append(ten.fd)
        ten.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        seg = _Segment(n, path)
        ten.segments.append(seg)
        return seg

    def _scan(self, ten: _Tenant, seg: _Segment) -> None:
        data = seg.path.read_bytes()
        at = 0
        while at + _FRAME.size <= len(data):
            length, crc = _FRAME.unpack_from(data, at)
            end = at + _FRAME.size + length
            body = data[at + _FRAME.size : end]
            if length > MAX_RECORD_BYTES or end > len(data) or zlib.crc32(body) != crc:
                break
            try:
                ts, device, run, i, usr, conv, _payload = msgpack.unpackb(body, raw=False)
            except (ValueError, TypeError, msgpack.ExtraData):
                break
            seg.last_ts_ms = max(seg.last_ts_ms, ts)
            self._index(ten, seg.n, at, device, run, i, usr, conv, ts)
            at = end
        if at < len(data):
            # A torn or damaged tail: cut back to the last whole record.
            self.truncated += len(data) - at
            log.warning("event log segment %s: %d byte(s) after the last whole record cut",
                        seg.path, len(data) - at)  # fmt: skip
            with open(seg.path, "r+b") as f:
                f.truncate(at)
        seg.size = at

    @staticmethod
    def _index(
        ten: _Tenant, n: int, offset: int, device: str, run: str, i: int,
        usr: str | None, conv: str | None, ts_ms: int,
    ) -> None:  # fmt: skip
        key = (device, run)
        span = ten.times.get(key)
        if span is None:
            ten.times[key] = [ts_ms, ts_ms]
        else:
            span[0], span[1] = min(span[0], ts_ms), max(span[1], ts_ms)
        entries = ten.runs.get(key)
        if entries is None:
            entries = ten.runs[key] = []
        named = ten.named.get(key)
        if named is None:
            named = ten.named[key] = [None, None]
        if named[0] is None and usr is not None:
            named[0] = usr
        if named[1] is None and conv is not None:
            # A run joins its conversation with the first record that names it (its
            # run.started, usually its first).
            named[1] = conv
            ten.convs.setdefault(conv, {})[key] = None
        entries.append((n, offset, i))
        if named[1] is not None:
            ten.conv_last[named[1]] = (n, offset)


def _check_tenant(tenant: str) -> None:
    try:
        check_id(tenant, "tenant")
    except BadTopic as e:
        raise EventLogError(str(e)) from None


def _read_record(f: BinaryIO) -> LoggedEvent:
    head = f.read(_FRAME.size)
    if len(head) != _FRAME.size:
        raise EventLogError("an event log record is missing")
    length, crc = _FRAME.unpack(head)
    body = f.read(length)
    if len(body) != length or zlib.crc32(body) != crc:
        raise EventLogError("an event log record is damaged")
    ts, device, run, i, usr, conv, payload = msgpack.unpackb(body, raw=False)
    return LoggedEvent(ts, device, run, i, usr, conv, payload)
