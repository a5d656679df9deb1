# The demo agent: a room thermostat with one local tool. A board's main.py is just
#   from edge_runtime.demo import main; main()
from edge_runtime import platform
from edge_runtime.agent import Agent

agent = Agent(
    "thermostat",
    "0.1.0",
    "You are the assistant of a room thermostat. Answer questions about the room; "
    "use read_temperature to measure before you state a temperature.",
)

_sim = {"celsius": 21.5}


def _read_rp2040_sensor():
    # RP2040's internal sensor on ADC 4 (datasheet formula); other boards fall back.
    import machine
    raw = machine.ADC(4).read_u16() * 3.3 / 65535
    return round(27 - (raw - 0.706) / 0.001721, 1)


@agent.tool("read_temperature", "Read the room temperature in degrees Celsius")
def read_temperature(args):
    try:
        return _read_rp2040_sensor()
    except (ImportError, AttributeError, ValueError, OSError) as e:
        if not _sim.get("logged"):
            _sim["logged"] = True
            platform.log("no on-chip sensor (%s); reading the simulated one" % type(e).__name__)
        return _sim["celsius"]


def main(settings=None):
    from edge_runtime import board

    settings = settings if settings is not None else platform.load_settings()
    if "sim_celsius" in settings:
        _sim["celsius"] = settings["sim_celsius"]
    board.start(agent, settings)


if __name__ == "__main__":
    main()
