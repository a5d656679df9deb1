# A shop kiosk that answers from its manuals: the board's main.py (`wren board --virtual
# --main examples/kiosk/main.py`). The manuals live on the bridge (`wren kb ingest
# examples/kiosk/manuals ...`); before each model call the bridge retrieves the passages
# for the question and adds them to the call, marked as data, and the host gets a
# `citation` event for each (docs={"mode": "before"}: PROTOCOL.md "Knowledge in runs").
# The board holds no passage and no index. README.md, "Knowledge", says how to run it.
from edge_runtime import board
from edge_runtime.agent import Agent

agent = Agent(
    "kiosk",
    "1.0",
    "You answer customers at a shop kiosk. Answer from the passages you are given and "
    "cite them by number; say so when they do not answer the question.",
    docs={"mode": "before", "collections": ["manuals"], "k": 3},
)

board.start(agent)
