# Declared fields: a bad declaration fails where the app wrote it, hello carries only
# what differs from the contract's defaults. No broker: the hello a board sends with them
# is checked in test_memory.
from edge_runtime.agent import Agent
from edge_runtime.fields import Field
from firmware_tests.support import raises


def test_defaults_describe_as_the_name_alone():
    f = Field("notes")
    assert (f.vis, f.dur, f.merge, f.kind, f.max) == ("private", "run", "replace", "slot", 4096)
    assert f.describe() == {"name": "notes"}


def test_what_differs_from_the_defaults_is_described():
    f = Field("visits", vis="public", dur="user", merge="sum", fmt="number", ttl=3600)
    assert f.describe() == {"name": "visits", "vis": "public", "dur": "user", "merge": "sum",
                            "fmt": "number", "ttl": 3600}
    c = Field("facts", kind="collection", key="id", stream=True, max=50, dur="agent")
    assert c.describe() == {"name": "facts", "kind": "collection", "key": "id", "stream": True,
                            "max": 50, "dur": "agent"}
    core = Field("persona", dur="agent", core=True, max=2000)
    assert core.describe() == {"name": "persona", "dur": "agent", "core": True, "max": 2000}


def test_bad_declarations_are_value_errors():
    bad = [
        lambda: Field(""),
        lambda: Field("Has-Caps"),
        lambda: Field("x" * 65),
        lambda: Field(5),
        lambda: Field("a", vis="secret"),
        lambda: Field("a", dur="forever"),
        lambda: Field("a", merge="add"),
        lambda: Field("a", kind="table"),
        lambda: Field("a", fmt=""),
        lambda: Field("a", stream=1),
        lambda: Field("a", max=0),
        lambda: Field("a", max=True),
        lambda: Field("a", ttl=-5),
        lambda: Field("a", core=True),  # dur run: core needs agent or user
        lambda: Field("a", core=True, dur="tenant"),
        lambda: Field("a", core=True, dur="agent", kind="collection"),
        lambda: Field("a", key="id"),  # a key is for collections
    ]
    for make in bad:
        raises(ValueError, make)
    assert Field("x" * 64).name == "x" * 64


def test_an_agent_takes_unique_fields_and_one_core_field_per_scope():
    a = Agent("a", "1", "", fields=[Field("n", core=True, dur="agent"),
                                    Field("u", core=True, dur="user"), Field("k")])
    assert a.field("u").dur == "user" and a.field("missing") is None
    assert [d["name"] for d in a.describe_fields()] == ["n", "u", "k"]
    raises(ValueError, Agent, "a", "1", "", None, [Field("n"), Field("n")])
    raises(ValueError, Agent, "a", "1", "", None,
           [Field("n", core=True, dur="agent"), Field("m", core=True, dur="agent")])
    raises(ValueError, Agent, "a", "1", "", None, [{"name": "n"}])
    assert Agent("b", "1", "").describe_fields() == []
