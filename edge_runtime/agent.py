# The agent declaration: name, version, instructions, tools and the handler.
# An app on the board builds one Agent and hands it to edge_runtime.board.start().


class RunFailed(Exception):
    # Raised by a handler (the model loop, or an app's own) to end its run as
    # run.failed with a customer-safe message.

    def __init__(self, kind, msg, retryable=False):
        super().__init__(msg)
        self.kind = kind
        self.msg = msg
        self.retryable = retryable


class Tool:
    # A local tool runs on the board: `fn(args) -> value`, sync or async. Client tools
    # (answered by the host app) need run pausing and arrive with checkpoints.

    def __init__(self, name, description, args, fn):
        self.name = name
        self.description = description
        self.args = args or {"type": "object", "properties": {}}
        self.fn = fn

    def describe(self):
        return {"name": self.name, "description": self.description, "args": self.args,
                "client": False}

    def model_spec(self):
        return {"name": self.name, "description": self.description, "args": self.args}


class Agent:
    def __init__(self, name, version, instructions, handler=None, fields=None,
                 model=None, max_tokens=None, max_steps=8):
        self.name = name
        self.version = version
        self.instructions = instructions
        # None means the default handler: the model tool loop (edge_runtime.toolloop).
        self.handler = handler
        self.fields = fields or []
        self.model = model
        self.max_tokens = max_tokens
        self.max_steps = max_steps
        self.tools = {}

    def tool(self, name, description, args=None):
        # Decorator: @agent.tool("read_temperature", "Read the room sensor in °C")
        def register(fn):
            self.tools[name] = Tool(name, description, args, fn)
            return fn
        return register

    def describe(self):
        return [t.describe() for t in self.tools.values()]
