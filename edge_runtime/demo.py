# The demo agent: a room thermostat with two local tools and one memory: each user's
# usual temperature, a durable user field the bridge keeps, so "set it to my usual"
# works in a later request (and on another board of the same tenant and agent).
# A board's main.py is just
#   from edge_runtime.demo import main; main()
from edge_runtime import platform
from edge_runtime.agent import Agent

agent = Agent(
    "thermostat",
    "0.1.0",
    "You are the assistant of a room thermostat. Answer questions about the room; "
    "use read_temperature to measure before you state a temperature. When a user "
    "tells you their usual temperature, remember it in usual_celsius.",
)

_sim = {"celsius": 21.5, "setpoint": None}


@agent.tool("read_temperature", "Read the room temperature in degrees Celsius")
def read_temperature(args):
    try:
        # RP2040's internal sensor on ADC 4 (datasheet formula); other boards fall back.
        import machine
        raw = machine.ADC(4).read_u16() * 3.3 / 65535
        return round(27 - (raw - 0.706) / 0.001721, 1)
    except (ImportError, AttributeError, ValueError, OSError) as e:
        if not _sim.get("logged"):
            _sim["logged"] = True
            platform.log("no on-chip sensor (%s); reading the simulated one" % type(e).__name__)
        return _sim["celsius"]


@agent.tool("set_temperature", "Set the thermostat to a temperature in degrees Celsius",
            {"type": "object", "properties": {"celsius": {"type": "number"}},
             "required": ["celsius"]})
def set_temperature(args):
    celsius = args.get("celsius")
    if isinstance(celsius, bool) or not isinstance(celsius, (int, float)) or not 5 <= celsius <= 35:
        raise ValueError("celsius must be a number from 5 to 35")
    _sim["setpoint"] = celsius
    return "set to %s °C" % celsius


def main(settings=None):
    from edge_runtime import board

    settings = settings if settings is not None else platform.load_settings()
    if "sim_celsius" in settings:
        _sim["celsius"] = settings["sim_celsius"]
    if settings.get("memory", True):
        # Declared here, not with the agent: a board set "memory": false runs the
        # thermostat without its memory field, and never loads the memory code (the
        # fields module, the memory tools, state load and commit), about 15 KiB of heap.
        from edge_runtime.fields import Field, check

        agent.fields = [Field("usual_celsius", vis="public", dur="user", fmt="number")]
        check(agent.fields)
    board.start(agent, settings)


if __name__ == "__main__":
    main()
