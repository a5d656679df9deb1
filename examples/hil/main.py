# A tiny agent, and its hardware-in-the-loop tests beside it (test_agent.py): a weather
# station with one local tool (a function on the board) and one client tool (no
# function: the host app answers it, and a test can). README.md, "Test your agent with
# the hardware in the loop", says how to run the tests on the unix port and on a board.
from edge_runtime import board
from edge_runtime.agent import Agent

agent = Agent(
    "station",
    "1.0",
    "You run a small weather station. Read the sensor before you state a temperature; "
    "ask the user before you open the vent.",
)


@agent.tool("read_temperature", "The air temperature in degrees Celsius")
def read_temperature(args):
    # A real board reads its sensor here (machine.ADC, an I2C part); the example's
    # reading is fixed, so that a test can check the number the answer quotes.
    return 21.5


agent.tool("ask_user", "Ask the user a yes/no question",
           {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})(None)

board.start(agent)
