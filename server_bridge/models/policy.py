"""What a board's model call may cost: the bridge decides, not the board.

A board's `llm.complete` may name a `model` and a `max_tokens` (its agent's `model` and
`max_tokens`). Neither is trusted: a board asked a server configured for a cheap model for
`the-most-expensive-model` and `max_tokens` 2**63 - 1, and got them (issue 25). The rules
(PROTOCOL.md "Model calls"):

- **Model.** The bridge's own model (`--model`, the provider's) is the default and always
  allowed; a call that names none gets it. Any other model must be on the operator's
  allow-list (`--allow-model`), for every tenant (`*`), for a tenant (`<tenant>`) or for
  one agent of a tenant (`<tenant>/<agent>`), the lists adding up; `*` as a model allows
  any. A call naming a model outside it is refused, `model_not_allowed`, not retryable:
  never swapped for the default behind the agent's back, since an agent written for one
  model and answered by another fails in ways nobody can trace.
- **Tokens.** `max_tokens` is at most the bridge's cap (`--max-tokens`, BridgeConfig
  `llm_max_tokens`), which is also what a call naming none gets: a larger one is cut to
  the cap (the answer then ends `finish: "length"`, which the host is told).
- **Per run** (by the run id the call names, `r`): at most `run_calls` model calls,
  `run_tokens` tokens in and out as the model reported them, and `run_s` seconds of model
  time. A call past one is refused `run_limit`, not retryable; a call's `max_tokens` is
  also cut to the run's tokens left, and the call is given no more time than the run has
  left. The run id is the board's to name, so these bound an agent that loops, not a
  hostile board (a board that makes up a new run id per call has only the per-call caps,
  and the bridge's in-flight caps per device).

`ModelPolicy` is the operator's configuration; `ModelGate` applies it and keeps what each
run has spent (bounded: the most recent RECENT_RUNS runs).
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from server_bridge.models.base import ModelError

__all__ = [
    "ANY",
    "RECENT_RUNS",
    "Admitted",
    "ModelGate",
    "ModelPolicy",
    "ModelRefused",
    "merge_allowed",
    "parse_allow",
]

# As a scope: every tenant; as a model: any model.
ANY = "*"
# Runs whose spending is kept: a run past this many more recent ones starts again from
# nothing. A run makes its calls within minutes; 4,096 runs is a fleet's worth of them in
# flight at once, at ~200 bytes each.
RECENT_RUNS = 4096
# A scope on the command line: `*`, `<tenant>` or `<tenant>/<agent>` (tenant ids are the
# topic alphabet; an agent is any printable text without `=`).
_SCOPE = re.compile(r"(\*|[a-z0-9][a-z0-9_-]*(/[^=\s][^=]*)?)\Z")
# How much of a refused model's name a refusal repeats.
_NAME_SHOWN = 64


class ModelRefused(ModelError):
    """A call the bridge will not make: `cause` says why (`model_not_allowed`,
    `run_limit`); never retryable, since the same call is refused the same way."""

    def __init__(self, msg: str, cause: str) -> None:
        super().__init__(msg, cause, False)


@dataclass(frozen=True)
class ModelPolicy:
    """The operator's rules for model calls besides the per-call token cap.

    `allowed` maps a scope — `*`, a tenant id, or `<tenant>/<agent>` — to the models a
    board there may name besides the bridge's own; `*` as a model allows any."""

    allowed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    run_calls: int = 32
    run_tokens: int = 200_000
    run_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.run_calls < 1 or self.run_tokens < 1:
            raise ValueError("run_calls and run_tokens must be >= 1")
        if not 0 < self.run_s < math.inf:
            raise ValueError("run_s must be a number of seconds > 0")
        for scope, models in self.allowed.items():
            if not _SCOPE.match(scope):
                raise ValueError(f"bad scope {scope!r}: expected *, TENANT or TENANT/AGENT")
            if not all(isinstance(m, str) and m for m in models):
                raise ValueError(f"the models of {scope!r} must be non-empty strs")

    def allows(self, tenant: str, agent: str, model: str) -> bool:
        """Whether `model` is on the list for an agent of a tenant (the bridge's own model
        is not asked about: it is always allowed)."""
        for scope in (ANY, tenant, f"{tenant}/{agent}"):
            models = self.allowed.get(scope)
            if models and (model in models or ANY in models):
                return True
        return False


def parse_allow(text: str) -> tuple[str, frozenset[str]]:
    """`[SCOPE=]MODEL[,MODEL...]` (the `--allow-model` option) as (scope, models); the
    scope `*` when none is given. ValueError, in words a user can act on, otherwise."""
    scope, sep, names = text.partition("=")
    if not sep:
        scope, names = ANY, text
    scope = scope.strip()
    if not _SCOPE.match(scope):
        raise ValueError(f"expected [*|TENANT|TENANT/AGENT=]MODEL[,MODEL...], got {text!r}")
    models = frozenset(m.strip() for m in names.split(",") if m.strip())
    if not models:
        raise ValueError(f"no model named in {text!r}")
    return scope, models


def merge_allowed(entries: list[tuple[str, frozenset[str]]]) -> dict[str, frozenset[str]]:
    """Several `--allow-model` entries as one map, the models of a scope added up."""
    allowed: dict[str, frozenset[str]] = {}
    for scope, models in entries:
        allowed[scope] = allowed.get(scope, frozenset()) | models
    return allowed


@dataclass(frozen=True)
class Admitted:
    """What an admitted call may do: the model to ask for (None: the provider's own),
    its max_tokens, and the model time its run has left (None: a call naming no run)."""

    model: str | None
    max_tokens: int
    run_left_s: float | None


@dataclass
class _Spent:
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0


class ModelGate:
    """Applies a ModelPolicy and the token cap to each call, and keeps what each run
    spent. Thread-safe: `admit` runs on paho's network thread, `spend` on the RPC
    workers; both only take a short lock."""

    def __init__(
        self,
        default_model: str | None,
        max_tokens: int,
        policy: ModelPolicy | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.default_model = default_model
        self.max_tokens = max_tokens
        self.policy = policy or ModelPolicy()
        self._lock = threading.Lock()
        self._runs: OrderedDict[tuple[str, str], _Spent] = OrderedDict()

    def admit(
        self,
        tenant: str,
        agent: str,
        device: str,
        run: str | None,
        model: str | None,
        max_tokens: int | None,
    ) -> Admitted:
        """The call's model and max_tokens as the bridge allows them, counted against its
        run; ModelRefused (not retryable) for a call the bridge will not make."""
        policy = self.policy  # one read: a policy swapped meanwhile applies to the next
        if model is not None and model != self.default_model:
            if not policy.allows(tenant, agent, model):
                shown = model[:_NAME_SHOWN] + ("..." if len(model) > _NAME_SHOWN else "")
                raise ModelRefused(
                    f"the bridge does not allow model {shown!r} for this agent: leave the "
                    "agent's model unset, or ask the bridge's operator to allow it "
                    "(--allow-model)",
                    "model_not_allowed",
                )
        tokens = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        if run is None:
            return Admitted(model, tokens, None)
        with self._lock:
            key = (device, run)
            spent = self._runs.pop(key, None) or _Spent()
            self._runs[key] = spent  # now the most recent
            while len(self._runs) > RECENT_RUNS:
                self._runs.popitem(last=False)
            if spent.calls >= policy.run_calls:
                what = f"made {spent.calls} model calls"
                flag = "--run-model-calls"
            elif spent.tokens >= policy.run_tokens:
                what = f"used {spent.tokens} model tokens"
                flag = "--run-model-tokens"
            elif spent.seconds >= policy.run_s:
                what = f"spent {spent.seconds:.0f} s on model calls"
                flag = "--run-model-time"
            else:
                spent.calls += 1
                tokens = min(tokens, policy.run_tokens - spent.tokens)
                return Admitted(model, tokens, policy.run_s - spent.seconds)
        raise ModelRefused(
            f"this run has {what}, the most the bridge allows one run ({flag}): "
            "start a new request, or ask for less",
            "run_limit",
        )

    def spend(self, device: str, run: str | None, seconds: float, tokens: int) -> None:
        """Add a finished call's model time and tokens (in and out) to its run."""
        if run is None:
            return
        with self._lock:
            spent = self._runs.get((device, run))
            if spent is not None:
                spent.seconds += max(0.0, seconds)
                spent.tokens += max(0, tokens)

    def runs(self) -> int:
        """How many runs' spending is kept."""
        with self._lock:
            return len(self._runs)
