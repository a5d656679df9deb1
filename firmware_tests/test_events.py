from edge_runtime import codec
from edge_runtime.events import Emitter
from firmware_tests.support import raises


def _emitter(ring=3):
    sent = []
    clock = [1000]

    def tick():
        clock[0] += 1
        return clock[0]

    return Emitter("b00t.1", codec.encode, sent.append, tick, ring), sent


def test_ids_count_from_one_without_gaps_and_go_out_encoded():
    em, sent = _emitter()
    em.emit("run.started", {"agent": "a"})
    em.emit("msg.delta", {"m": 1, "text": "hi"}, node="plan")
    got = [codec.decode(b) for b in sent]
    assert [e["i"] for e in got] == [1, 2]
    assert got[1] == {"r": "b00t.1", "i": 2, "t": "msg.delta", "ts": 1002, "d": {"m": 1, "text": "hi"},
                      "n": "plan"}


def test_unknown_type_is_a_programming_error():
    em, sent = _emitter()
    raises(ValueError, em.emit, "msg.teleport")
    assert sent == [] and em.last_id == 0


def test_replay_within_the_ring_resends_exact_bytes():
    em, sent = _emitter(ring=3)
    for n in range(3):
        em.emit("msg.delta", {"m": 1, "text": str(n)})
    first = list(sent)
    del sent[:]
    em.replay(1)
    assert sent == first[1:]


def test_replay_past_the_ring_reports_the_lost_ids_as_a_gap():
    em, sent = _emitter(ring=3)
    for n in range(6):
        em.emit("msg.delta", {"m": 1, "text": str(n)})
    del sent[:]
    em.replay(0)
    got = [codec.decode(b) for b in sent]
    assert [e["i"] for e in got] == [4, 5, 6, 7]
    gap = got[-1]
    assert gap["t"] == "error" and gap["d"]["kind"] == "gap"
    assert (gap["d"]["from"], gap["d"]["to"]) == (1, 3)


def test_replay_after_the_last_id_sends_nothing():
    em, sent = _emitter()
    em.emit("run.done", {"usage": {}})
    del sent[:]
    em.replay(1)
    assert sent == []


def test_an_event_that_cannot_be_encoded_spends_no_id():
    em, sent = _emitter()
    em.emit("msg.delta", {"m": 1, "text": "ok"})
    raises(codec.TooLarge, em.emit, "tool.result", {"call": "c", "output": "x" * 20000})
    em.emit("run.done", {"usage": {}})
    assert [codec.decode(b)["i"] for b in sent] == [1, 2]
    del sent[:]
    em.replay(0)
    assert [codec.decode(b)["t"] for b in sent] == ["msg.delta", "run.done"]
