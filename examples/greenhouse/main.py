# A greenhouse watering agent: the board's main.py (`wren board --virtual --main
# examples/greenhouse/main.py`). It shows what issue 9 built, on a board:
#
# - nodes: the handler marks its own step (/sense, a sensor read in plain code) and,
#   when a bed is dry, hands the run to the model loop, which marks its steps and tools
#   (/model, /tool/<name>) itself; when nothing is dry it answers without a model call
#   (/report). Hosts see node.start / node.end, the edge taken and usage per model step.
# - a client tool (ask_gardener, no function: the host app answers it) and an approval
#   (open_valve: a person says yes to each call): the run pauses, leaves the board's
#   memory, and resumes from its checkpoint when the answers come, after a reboot too.
# - a budget: at most 12 steps (nodes) and 120 s of wall time a run, paused time left out.
#
# README.md, "An example: the greenhouse", says how to run it and what a host sees.
from edge_runtime import board, nodes, platform
from edge_runtime.agent import Agent
from edge_runtime.toolloop import model_loop

# Soil moisture of each bed, in %: a simulation a real board would read from its ADC.
_beds = {"1": 41, "2": 18, "3": 36}
_DRY = 25  # below this, a bed needs water


async def _say(run, text):
    # An answer of the handler's own, as the model loop streams one.
    await run.event("msg.start", {"m": 1, "role": "assistant"})
    await run.event("msg.delta", {"m": 1, "text": text})
    await run.event("msg.end", {"m": 1})


async def handle(run):
    async with nodes.Node(run, "/sense", "sensor") as sense:
        dry = [bed for bed in sorted(_beds) if _beds[bed] < _DRY]
        sense.port = "dry" if dry else "moist"
    if not dry:
        async with nodes.Node(run, "/report", "text"):
            await _say(run, "Every bed is moist (%s); no watering needed." % ", ".join(
                "bed %s %d %%" % (bed, _beds[bed]) for bed in sorted(_beds)))
        return {}
    # The model decides how much water, and asks before it opens a valve.
    await nodes.edge(run, "/sense", "dry", "/model")
    return await model_loop(run)


agent = Agent(
    "greenhouse",
    "1.0",
    "You water a greenhouse. Read the soil moisture before you decide; open a bed's "
    "valve only as long as it needs; ask the gardener when the request leaves a choice.",
    handler=handle,
    budget={"steps": 12, "wall_s": 120},
)


@agent.tool("read_moisture", "Soil moisture of each bed, in percent")
def read_moisture(args):
    return dict(_beds)


@agent.tool("open_valve", "Water one bed for some minutes",
            {"type": "object", "properties": {"bed": {"type": "string"},
                                              "minutes": {"type": "integer"}},
             "required": ["bed", "minutes"]}, approval=True)
def open_valve(args):
    bed, minutes = str(args.get("bed")), args.get("minutes")
    if bed not in _beds or not isinstance(minutes, int) or not 1 <= minutes <= 30:
        raise ValueError("bed must be one of %s and minutes 1-30" % ", ".join(sorted(_beds)))
    _beds[bed] = min(60, _beds[bed] + 2 * minutes)
    platform.log("valve", bed, "open for", minutes, "min")
    return "bed %s watered for %d minutes; now %d %%" % (bed, minutes, _beds[bed])


agent.tool("ask_gardener", "Ask the gardener a question",
           {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})(None)

board.start(agent)
