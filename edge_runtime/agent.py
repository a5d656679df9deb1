# The agent declaration: name, version, instructions, tools and the handler.
# An app on the board builds one Agent and hands it to edge_runtime.board.start().


class RunFailed(Exception):
    # Raised by a handler (the model loop, or an app's own) to end its run as
    # run.failed with a customer-safe message; `cause` says why a model call failed
    # (the bridge's, PROTOCOL.md "Errors").

    def __init__(self, kind, msg, retryable=False, cause=None):
        super().__init__(msg)
        self.kind = kind
        self.msg = msg
        self.retryable = retryable
        self.cause = cause


class Tool:
    # A local tool runs on the board: `fn(args) -> value`, sync or async; with
    # `approval` each call waits for a person's yes first. A client tool has no `fn`:
    # the host app answers it. Either pauses the run (pause.py).

    def __init__(self, name, description, args, fn, approval=False):
        self.name = name
        self.description = description
        self.args = args or {"type": "object", "properties": {}}
        self.fn = fn
        self.approval = approval

    def describe(self, hello=True):
        # The tool as the model sees it; hello also says who answers it (the board or
        # the host app), and whether a person approves each call.
        d = {"name": self.name, "description": self.description, "args": self.args}
        if hello:
            d["client"] = self.fn is None
            if self.approval:
                d["approval"] = True
        return d


class Agent:
    # fields: edge_runtime.fields.Field declarations (names unique, at most one core
    # field per scope: core memory is one document per scope). context_chars bounds what
    # one model call carries: instructions, core memory and the conversation, trimmed
    # oldest first to fit (toolloop). budget: what one run may spend, any of
    # {"steps": nodes started, "tokens": model tokens in and out, "wall_s": seconds not
    # paused, "reads": memory reads from the bridge} (budget.py, PROTOCOL "Budgets").
    # docs: the agent's rule for the documents the bridge holds (its knowledge),
    # {"mode": "before" (the bridge adds passages to each model call) or "tool" (the
    # model may call kb.search), "collections", "k", "max_chars", "on_error": "fail"
    # or "skip"} (docs.py, PROTOCOL "Knowledge in runs"); None: off.
    def __init__(self, name, version, instructions, handler=None, fields=None,
                 model=None, max_tokens=None, max_steps=8, context_chars=6000, budget=None,
                 docs=None):
        self.name = name
        self.version = version
        self.instructions = instructions
        # None means the default handler: the model tool loop (edge_runtime.toolloop).
        self.handler = handler
        self.fields = list(fields or ())
        if self.fields:
            # An app that declares fields has imported them already.
            from edge_runtime.fields import check
            check(self.fields)
        self.model = model
        self.max_tokens = max_tokens
        self.max_steps = max_steps
        self.context_chars = context_chars
        self.budget = budget or None
        if budget:
            # Checked once, here; budget.py stays loaded for the agent's runs.
            from edge_runtime import budget as limits
            limits.check(budget)
        # Named `docs`, module and all: a name the board's qstr pool has already, so
        # an agent without knowledge adds none (test_on_small_heap).
        self.docs = None
        if docs:
            from edge_runtime import docs as rule
            self.docs = rule.check(docs)
        self.tools = {}
        self.specs = None
        # The board's runtime, once one runs this agent (runs.Runtime): docs.add
        # reaches the bridge through it.
        self.runtime = None

    def field(self, name):
        # A declared field by name, or None (an undeclared key is private and run-scoped).
        for f in self.fields:
            if f.name == name:
                return f
        return None

    def tool(self, name, description, args=None, approval=False):
        # Decorator: @agent.tool("read_temperature", "Read the room sensor in °C").
        # A client tool, answered by the host app, is one with no function:
        # agent.tool("ask_user", "Ask the user", {...})(None).
        def register(fn):
            self.tools[name] = Tool(name, description, args, fn, approval)
            self.specs = None  # the tools as the model sees them, encoded (toolloop)
            return fn
        return register

    def describe(self):
        return [t.describe() for t in self.tools.values()]

    def describe_fields(self):
        return [f.describe() for f in self.fields]
