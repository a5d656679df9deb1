from edge_runtime import codec
from edge_runtime.events import Emitter
from firmware_tests.support import raises


class Outbox:
    # The link's side of an emitter: takes payloads while it has room for another
    # message, like Link.publish. `sent` is every event it took, one bytes each, also
    # those of a batch (a list of parts, as the link writes it: a msgpack array header,
    # then each event's bytes); `messages` is how many payloads each message carried.
    def __init__(self, room=1000):
        self.sent = []
        self.messages = []
        self.room = room

    def send(self, data):
        if len(self.messages) >= self.room:
            return False
        if isinstance(data, list):
            events = [bytes(part) for part in data[1:]]
            # A batch is one msgpack array of the envelopes, each as the ring holds it.
            assert len(events) >= 2 and bytes(data[0]) == bytes([0x90 | len(events)])
            assert codec.decode(b"".join(bytes(part) for part in data)) == [
                codec.decode(e) for e in events]
        else:
            events = [data]
        self.sent.extend(events)
        self.messages.append(len(events))
        return True

    def ids(self):
        return [codec.decode(b)["i"] for b in self.sent]


def _emitter(ring=3, room=1000, ring_bytes=2048):
    out = Outbox(room)
    clock = [1000]

    def tick():
        clock[0] += 1
        return clock[0]

    return Emitter("b00t.1", codec.encode, out.send, tick, ring, ring_bytes), out


def _emit(em, t, d=None, node=None):
    # As a run emits (Run.emit): the event, then whatever waits is handed to the link.
    em.emit(t, d, node)
    return em.pump()


def test_ids_count_from_one_without_gaps_and_go_out_encoded():
    em, out = _emitter()
    _emit(em, "run.started", {"agent": "a"})
    _emit(em, "node.start", {"kind": "model"}, ("/plan", 2))
    _emit(em, "node.end", {"status": "completed"}, ("/plan/search", 1, 3))
    got = [codec.decode(b) for b in out.sent]
    assert [e["i"] for e in got] == [1, 2, 3]
    assert got[0] == {"r": "b00t.1", "i": 1, "t": "run.started", "ts": 1001, "d": {"agent": "a"}}
    # A node's event carries its path, its activation and, when given, its iteration.
    assert got[1] == {"r": "b00t.1", "i": 2, "t": "node.start", "ts": 1002, "d": {"kind": "model"},
                      "n": "/plan", "a": 2}
    assert got[2] == {"r": "b00t.1", "i": 3, "t": "node.end", "ts": 1003,
                      "d": {"status": "completed"}, "n": "/plan/search", "a": 1, "k": 3}


def test_unknown_type_is_a_programming_error():
    em, out = _emitter()
    raises(ValueError, em.emit, "msg.teleport")
    # The types are one space-separated str: a piece of a name, or two names, is no type.
    for etype in ("run", "msg.delta msg.end", "", " ", "error "):
        raises(ValueError, em.emit, etype)
    assert out.sent == [] and em.last_id == 0


def test_replay_within_the_ring_resends_exact_bytes():
    em, out = _emitter(ring=3)
    for n in range(3):
        _emit(em, "msg.delta", {"m": 1, "text": str(n)})
    first = list(out.sent)
    del out.sent[:]
    em.replay(1)
    assert out.sent == first[1:]


def test_replay_past_the_ring_reports_the_lost_ids_as_a_gap():
    em, out = _emitter(ring=3)
    for n in range(6):
        _emit(em, "msg.delta", {"m": 1, "text": str(n)})
    del out.sent[:]
    em.replay(0)
    got = [codec.decode(b) for b in out.sent]
    assert [e["i"] for e in got] == [4, 5, 6, 7]
    gap = got[-1]
    assert gap["t"] == "error" and gap["d"]["kind"] == "gap"
    assert (gap["d"]["from"], gap["d"]["to"]) == (1, 3)


def test_replay_after_the_last_id_sends_nothing():
    em, out = _emitter()
    _emit(em, "run.done", {"usage": {}})
    del out.sent[:]
    em.replay(1)
    assert out.sent == []


def test_an_event_that_cannot_be_encoded_spends_no_id():
    em, out = _emitter()
    _emit(em, "msg.delta", {"m": 1, "text": "ok"})
    raises(codec.TooLarge, em.emit, "tool.result", {"call": "c", "output": "x" * 20000})
    _emit(em, "run.done", {"usage": {}})
    assert out.ids() == [1, 2]
    del out.sent[:]
    em.replay(0)
    assert [codec.decode(b)["t"] for b in out.sent] == ["msg.delta", "run.done"]


def test_an_event_the_link_cannot_take_waits_in_the_ring_and_goes_out_in_order():
    em, out = _emitter(ring=4, room=1)
    for n in range(3):
        _emit(em, "msg.delta", {"m": 1, "text": str(n)})
    assert out.ids() == [1] and em.backlog == 2 and em.lost == 0
    assert not em.pump()  # still no room: nothing moves, nothing is lost
    out.room = 10
    assert em.pump()
    assert out.ids() == [1, 2, 3] and em.backlog == 0


def test_events_overwritten_before_the_link_took_them_are_reported_as_a_gap():
    em, out = _emitter(ring=2, room=1)
    for n in range(5):
        _emit(em, "msg.delta", {"m": 1, "text": str(n)})
    # Ids 2 and 3 were overwritten in the ring before the link had room for them.
    assert em.lost == 2
    out.room = 10
    assert em.pump()
    got = [codec.decode(b) for b in out.sent]
    assert [e["i"] for e in got] == [1, 4, 5, 6]
    assert got[-1]["t"] == "error" and (got[-1]["d"]["from"], got[-1]["d"]["to"]) == (2, 3)


def test_a_gap_report_waits_until_nothing_else_does():
    # The report goes out only once nothing waits, so its ring slot held a sent event.
    em, out = _emitter(ring=2, room=1)
    for n in range(4):
        _emit(em, "msg.delta", {"m": 1, "text": str(n)})
    assert em.lost == 1  # id 2, overwritten by id 4
    out.room = 2  # room for one more message: ids 3 and 4 together, not yet the report
    em.pump()
    assert out.ids() == [1, 3, 4] and out.messages == [1, 2] and em.backlog == 1
    out.room = 10
    assert em.pump()
    got = [codec.decode(b) for b in out.sent]
    assert [e["i"] for e in got] == [1, 3, 4, 5] and em.lost == 1
    assert got[-1]["t"] == "error" and (got[-1]["d"]["from"], got[-1]["d"]["to"]) == (2, 2)


def test_a_ring_keeps_within_its_bytes_but_never_gives_up_an_event_still_waiting():
    em, out = _emitter(ring=16, ring_bytes=200)
    for n in range(6):
        _emit(em, "msg.delta", {"m": 1, "text": str(n) * 40})  # about 75 bytes each
    assert len(em.ring) == 2 and em.lost == 0
    del out.sent[:]
    em.replay(0)
    got = [codec.decode(b) for b in out.sent]
    assert [e["i"] for e in got] == [5, 6, 7] and (got[-1]["d"]["from"], got[-1]["d"]["to"]) == (1, 4)
    # With the link full, waiting events stay in the ring whatever their bytes.
    em, out = _emitter(ring=16, ring_bytes=200, room=1)
    for n in range(5):
        _emit(em, "msg.delta", {"m": 1, "text": str(n) * 40})
    assert len(em.ring) == 5 and em.backlog == 4 and em.lost == 0
    out.room = 100
    assert em.pump() and out.ids() == [1, 2, 3, 4, 5]


def test_a_finished_runs_ring_moved_into_one_block_replays_the_same_bytes():
    em, out = _emitter(ring=16, ring_bytes=400)
    for n in range(5):
        _emit(em, "msg.delta", {"m": 1, "text": "x" * (10 + 7 * n)})
    first = [bytes(b) for b in out.sent]
    em.settle()
    # Each event is now its place in one block, a small int: nothing allocated per event.
    assert all(isinstance(em.ring.at(k), int) for k in range(5))
    assert [bytes(em.held(k)) for k in range(5)] == first
    del out.sent[:]
    em.replay(2)
    assert [bytes(b) for b in out.sent] == first[2:]
    # Settling again changes nothing; events emitted after it (a gap report on a replay)
    # sit beside the moved ones, and over the byte budget the moved ones go first.
    em.settle()
    _emit(em, "error", {"kind": "gap", "msg": "y" * 30, "from": 1, "to": 1})
    _emit(em, "error", {"kind": "gap", "msg": "z" * 30, "from": 2, "to": 2})
    kept = 7 - len(em.ring)  # the oldest, let go for the two new ones
    assert 0 < kept < 5 and em.lost == 0
    del out.sent[:]
    em.replay(0)
    got = [codec.decode(bytes(b)) for b in out.sent]
    assert [e["i"] for e in got] == list(range(kept + 1, 9))
    assert [bytes(b) for b in out.sent[:5 - kept]] == first[kept:]
    assert [e["d"]["msg"][0] for e in got[5 - kept:7 - kept]] == ["y", "z"]
    assert (got[-1]["d"]["from"], got[-1]["d"]["to"]) == (1, kept)


def test_events_made_together_go_as_one_payload_and_one_alone_as_itself():
    em, out = _emitter(ring=16)
    # emit() only puts an event in the ring; pump() hands over what waits.
    em.emit("run.started", {"agent": "a"})
    em.emit("node.start", {"kind": "model"}, ("/model", 1, 1))
    em.emit("msg.start", {"m": 1, "role": "assistant"})
    assert out.sent == [] and em.backlog == 3
    assert em.pump() and out.messages == [3] and out.ids() == [1, 2, 3]
    # What waits alone goes as its own envelope, not a list of one.
    assert _emit(em, "msg.delta", {"m": 1, "text": "hi"})
    assert out.messages == [3, 1] and codec.decode(out.sent[-1])["i"] == 4


def test_a_batch_keeps_within_fifteen_events_and_1024_bytes():
    em, out = _emitter(ring=40, ring_bytes=8000, room=1)
    assert _emit(em, "msg.delta", {"m": 1, "text": "."})  # the one message there is room for
    for n in range(20):
        em.emit("msg.delta", {"m": 1, "text": str(n % 10)})
    out.room = 100
    assert em.pump()
    # A fixarray's most is 15 events.
    assert out.messages == [1, 15, 5] and out.ids() == list(range(1, 22))
    # By bytes: events of about 300 bytes go three to a payload (900), never four.
    em, out = _emitter(ring=40, ring_bytes=8000)
    for n in range(7):
        em.emit("msg.delta", {"m": 1, "text": "x" * 270})
    size = len(em.held(0))
    assert 3 * size <= 1024 < 4 * size
    assert em.pump() and out.messages == [3, 3, 1] and out.ids() == list(range(1, 8))
    # An event over the bound still goes, alone, as it always did.
    assert _emit(em, "tool.result", {"call": "c", "output": "y" * 1500})
    assert out.messages[-1] == 1 and len(out.sent[-1]) > 1024
