"""The memory methods as RPC handlers: who is calling, and answers the board can take.

The service (service.py) answers for a `Caller`; this module builds one for each call
from trusted sources only (PROTOCOL.md, "Scopes"):
- tenant, device and agent from the registry record of the call's MQTT user, and that
  agent's grants in its tenant from the registry's `grants` table (which `tenant`
  fields it may read or write);
- the declared fields from that device's last hello;
- user and conversation from the scope ticket `sc` the bridge signed into the request
  (tokens.verify_scope, bound to this device); a call without one reaches the agent,
  subject and tenant scopes only, and a bad or expired one is `bad_token`.
A `tenant`, `user`, `device` or `grant` key anywhere in the arguments is data and
changes none of that.

Answers go back on the board's receive buffer, so one larger than the payload its hello
announced is refused `too_large` (ask for fewer rows) instead of being sent to be read
past.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from server_bridge import tokens
from server_bridge.memory.errors import MemoryFault
from server_bridge.memory.service import Caller, MemoryService
from server_bridge.registry import DeviceRecord, RegistryStore
from server_bridge.rpc import CallContext, Emit, RpcError, RpcServer
from server_bridge.wire import BOARD_DEFAULTS, Limits, encode

__all__ = ["caller_of", "register", "state_seed"]

log = logging.getLogger("wren.bridge.memory")

HelloOf = Callable[[str], Mapping[str, Any] | None]
LimitsOf = Callable[[str], Limits | None]
# What an answer's envelope adds around `ok`: {c, s, ok} with a call id of up to 64.
_ENVELOPE = 96
# How long a memory call waits for its device's first hello (see _hello).
HELLO_WAIT_S = 2.0


def caller_of(
    ctx: CallContext, args: Mapping[str, Any], registry: RegistryStore, hello_of: HelloOf
) -> Caller:
    """The Caller of one call; RpcError(bad_token) for a scope ticket that proves nothing."""
    record = ctx.device
    user = conv = None
    ticket = args.get("sc")
    if ticket is not None:
        secret = registry.tenant_secret(record.tenant)
        if secret is None:
            raise RpcError("bad_token", f"no tenant {record.tenant!r} to verify the ticket against")
        try:
            scope = tokens.verify_scope(bytes.fromhex(secret), ticket, record.tenant, record.device)
        except tokens.TokenError as e:
            raise RpcError("bad_token", str(e)) from None
        user, conv = scope.user, scope.conv
    hello = _hello(hello_of, record.device) or {}
    fields = hello.get("fields")
    return Caller(
        tenant=record.tenant,
        device=record.device,
        agent=record.agent,
        user=user,
        conv=conv,
        run=ctx.call.r,
        fields=fields if isinstance(fields, list) else (),
        # From the registry's parsed snapshot: a dict lookup per call, and a grant added
        # or removed by another process applies within the registry's recheck time.
        grants=registry.grants_of(record.tenant, record.agent),
    )


def state_seed(
    service: MemoryService,
    registry: RegistryStore,
    record: DeviceRecord,
    user: str | None,
    conv: str | None,
    hello: Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    """The state a run of this user and conversation on `record`'s device would load,
    read as that run would read it: who is asking from the registry, the user and
    conversation the bridge is about to sign into the request's scope ticket (from the
    host's verified session token), the fields from the device's hello. None without a
    hello or whatever service.state_seed declines."""
    if hello is None:
        return None
    fields = hello.get("fields")
    if not isinstance(fields, list):
        return None
    caller = Caller(
        tenant=record.tenant,
        device=record.device,
        agent=record.agent,
        user=user,
        conv=conv,
        fields=fields,
        grants=registry.grants_of(record.tenant, record.agent),
    )
    return service.state_seed(caller)


def _hello(hello_of: HelloOf, device: str) -> Mapping[str, Any] | None:
    """The device's hello, waiting a moment for one in flight: a board says hello as
    soon as it sees a (re)started bridge, and its first run's state.load can be right
    behind it. On a worker thread, so the wait holds up no one else."""
    deadline = time.monotonic() + HELLO_WAIT_S
    while True:
        hello = hello_of(device)
        if hello is not None or time.monotonic() >= deadline:
            return hello
        time.sleep(0.02)


def register(
    rpc: RpcServer,
    service: MemoryService,
    registry: RegistryStore,
    hello_of: HelloOf,
    limits_of: LimitsOf,
) -> None:
    """Add every method of `service` to the RPC table."""
    for method in service.methods:
        rpc.register(method, _handler(service, method, registry, hello_of, limits_of))


def _handler(
    service: MemoryService,
    method: str,
    registry: RegistryStore,
    hello_of: HelloOf,
    limits_of: LimitsOf,
) -> Callable[[CallContext, dict[str, Any], Emit], Any]:
    def handler(ctx: CallContext, args: dict[str, Any], emit: Emit) -> Any:
        caller = caller_of(ctx, args, registry, hello_of)
        try:
            result = service.handle(caller, method, args)
        except MemoryFault as e:
            raise RpcError(e.kind, e.msg, e.extra) from None
        limits = limits_of(ctx.device.device) or BOARD_DEFAULTS
        size = len(encode(result)) + _ENVELOPE
        if size > limits.max_payload:
            # Applied, if it was a write (a repeat of its w answers the same): only the
            # answer is too large for the board to read.
            raise RpcError(
                "too_large",
                f"the answer to {method} is {size} bytes; device {ctx.device.device} reads "
                f"at most {limits.max_payload}: ask for fewer rows (limit, k)",
            )
        return result

    return handler
