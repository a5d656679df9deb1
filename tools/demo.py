"""What `wren demo`, `wren board --virtual` and `wren ask` run (`wren bridge` is the
bridge service, server_bridge/service.py).

The demo wires the real parts together on one machine: a broker that authenticates
every client (Mosquitto with a password file and ACL of our own, or the broker named
with --broker), the bridge with the scripted model, the virtual board on the
MicroPython unix port, and the terminal view of a host client.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from server_bridge import brokerconf
from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.eventlog import EventLog
from server_bridge.host.client import (
    BrokerRefused,
    HostClient,
    HostConnectError,
    RequestRefused,
    Unacknowledged,
)
from server_bridge.host.reducer import Presence, RunSnapshot
from server_bridge.host.terminal import (
    LiveView,
    print_transcript,
    render_presence,
    render_refusal,
    render_status,
)
from server_bridge.memory import open_memory
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider
from server_bridge.registry import Registry, provision
from server_bridge.service import DEFAULT_AGENT, STOP_EXIT_CODE, ServiceError, broker_tls
from server_bridge.tls import TLS_PORT
from server_bridge.tokens import dashboard_link, sign
from server_bridge.topics import DEFAULT_PREFIX
from tools.broker import BrokerError, MosquittoMissing, start_mosquitto
from tools.virtual_board import (
    MAIN_PY,
    BoardError,
    Console,
    VirtualBoard,
    fallback_notice,
    lay_out_flash,
    out_of_heap,
)

PREFIX = DEFAULT_PREFIX
TENANT = "demo"
AGENT = DEFAULT_AGENT
BRIDGE_USER = "bridge"
# The demo's terminal view. Another host process (`wren ask`) needs a host user of its
# own: the broker uses the user name as the client id, and two connections with one
# id knock each other off.
HOST_USER = f"host-{TENANT}"
START_TIMEOUT_S = 20.0
RUN_TIMEOUT_S = 60.0
# After the first request, `--once` shows memory: the user's usual temperature remembered
# in one request (a durable user field on the bridge) and used in the next.
MEMORY_REQUESTS = ("Make it 22 °C, and remember that is my usual.", "Set it to my usual.")


class DemoError(RuntimeError):
    """A part of the demo failed to start or a run did not finish; the message says which."""


@dataclass
class Credentials:
    user: str | None
    password: str | None


@dataclass
class BrokerHandle:
    host: str
    port: int
    kind: str
    stop: Any


def _users(device: str) -> dict[str, str]:
    return {
        BRIDGE_USER: secrets.token_urlsafe(18),
        device: secrets.token_urlsafe(18),
        HOST_USER: secrets.token_urlsafe(18),
    }


def start_demo_broker(
    workdir: Path,
    users: dict[str, str],
    bridges: Sequence[str] = (BRIDGE_USER,),
    hosts: Sequence[str] = (HOST_USER,),
) -> BrokerHandle:
    """Mosquitto with our password file and ACL: only these users, each in its own topics.

    `bridges` are the users with the bridge's rights and `hosts` the demo tenant's host
    users: the broker binds client ids to users, so each connection that must stay up
    alongside another has a user of its own (see server_bridge/brokerconf.py).
    """
    # Each bridge user also logs in as its control user, with the same password.
    extra = brokerconf.secure_mosquitto_conf(
        workdir,
        brokerconf.with_control_users(users, bridges),
        brokerconf.acl_text(PREFIX, bridges, {TENANT: hosts}),
    )
    try:
        m = start_mosquitto(workdir / "mosquitto", extra_conf=extra, allow_anonymous=False)
    except MosquittoMissing as e:
        # The one part the demo cannot start for the user: say how to get it.
        raise DemoError(f"{e}, or pass --broker HOST:PORT") from e
    except BrokerError as e:
        raise DemoError(f"the broker did not start: {e}") from e
    return BrokerHandle(m.host, m.port, f"mosquitto (pid {m.proc.pid}, config {m.workdir})", m.stop)


class BoardConsole:
    """The virtual board's console. Lines print live while the parts start; once the
    terminal view is drawing a run they wait and print after it, so the two never
    interleave mid-line."""

    def __init__(self, board: VirtualBoard, out: TextIO) -> None:
        self.board = board
        self.out = out
        self.live = True
        self.held: list[str] = []
        self.lock = threading.Lock()

    def pump(self) -> None:
        while True:
            proc = self.board.proc
            if proc is None or proc.stdout is None:
                return
            for line in proc.stdout:
                self.board.heard(line)
                with self.lock:
                    if self.live:
                        self._write(line)
                    else:
                        self.held.append(line)
            self.board.console_ended.set()
            # A board that reset itself (its heap could not recover) boots again, while
            # the demo still wants it (stop() ends it with another code).
            if not self.board.reset_itself():
                return
            self.board.start()

    def hold(self) -> None:
        with self.lock:
            self.live = False

    def release(self) -> None:
        with self.lock:
            for line in self.held:
                self._write(line)
            self.held.clear()
            self.live = True

    def _write(self, line: str) -> None:
        self.out.write(f"  board | {line.rstrip()}\n")
        self.out.flush()


def _board_exited(board: VirtualBoard) -> str:
    code = board.proc.returncode if board.proc is not None else None
    heap = board.died_of_heap()
    return f"the virtual board exited with code {code}" + (f": {heap}" if heap else "")


def _wait(pred: Any, timeout_s: float, what: str, board: VirtualBoard | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if board is not None and board.proc is not None and board.proc.poll() is not None:
            raise DemoError(f"{what}: {_board_exited(board)}")
        if time.monotonic() > deadline:
            raise DemoError(f"{what}: nothing within {timeout_s:.0f}s")
        time.sleep(0.05)


def _wait_run(client: HostClient, req: str, board: VirtualBoard) -> Any:
    # In one-second slices, so a board that crashed mid-run is reported at once rather
    # than after the whole run timeout.
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        try:
            return client.wait_run(req, timeout=1.0)
        except TimeoutError as e:
            if board.proc is not None and board.proc.poll() is not None:
                raise DemoError(_board_exited(board)) from e
            if time.monotonic() > deadline:
                raise DemoError(f"the run did not finish: {e}") from e


@contextlib.contextmanager
def _workdir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="wren-demo-") as tmp:
        yield Path(tmp)


def _serve_dashboard(
    stack: contextlib.ExitStack, bridge: Bridge, registry: Registry,
    address: tuple[str, int], out: TextIO,
) -> str | None:  # fmt: skip
    """The HTTP API and the dashboard, with a watcher's link to the page (12 hours); the
    page's address, None when the `http` extra is missing."""
    try:
        from server_bridge.http.server import HttpServer
    except ImportError as e:  # the `http` extra is not installed
        print(f"dashboard: not served ({e.name or e} is not installed: pip install "
              "'wren[http]')", file=out)  # fmt: skip
        return None
    server = HttpServer(bridge, address[0], address[1])
    server.start()
    stack.callback(server.stop)
    secret = registry.tenant_secret(TENANT)
    assert secret is not None
    token = sign(bytes.fromhex(secret), TENANT, "demo-user", ttl_s=12 * 3600, watch=True)
    print(f"dashboard: {dashboard_link(server.url, token)}", file=out)
    return f"{server.url}/ui/"


def _check_romfs(args: argparse.Namespace) -> None:
    # A ROMFS image holds .mpy for the unix port: neither sources nor CPython read one.
    if args.romfs and (args.py or args.cpython):
        raise BoardError(
            "--romfs runs .mpy on the MicroPython unix port: not with --py or --cpython"
        )


def run_demo(args: argparse.Namespace) -> int:
    out = sys.stdout
    device = args.device
    stack = contextlib.ExitStack()
    with stack:
        workdir = stack.enter_context(_workdir(args.workdir))
        if args.broker:
            host, port = args.broker
            # Each part logs in as itself: the bridge with --user/--password, the board
            # as its device id and the host as the tenant's host user, each with its own
            # password from the environment (none: the broker must allow anonymous).
            creds = {
                BRIDGE_USER: Credentials(args.user, args.password),
                device: Credentials(
                    os.environ.get("WREN_BOARD_USER", device), os.environ.get("WREN_BOARD_PASSWORD")
                ),
                HOST_USER: Credentials(
                    os.environ.get("WREN_HOST_USER"), os.environ.get("WREN_HOST_PASSWORD")
                ),
            }
            print(f"broker: using {host}:{port}", file=out)
        else:
            users = _users(device)
            handle = start_demo_broker(workdir, users)
            stack.callback(handle.stop)
            host, port = handle.host, handle.port
            creds = {name: Credentials(name, pw) for name, pw in users.items()}
            print(f"broker: {handle.kind} on {host}:{port}", file=out)

        registry = provision(workdir / "registry.json", TENANT, [(device, AGENT)])
        config = BridgeConfig(
            host=host,
            port=port,
            username=creds[BRIDGE_USER].user,
            password=creds[BRIDGE_USER].password,
            prefix=PREFIX,
        )
        # Memory keyword-ranked (BM25): the demo's one field is a slot, which nothing
        # searches, so the embedding model would only add to its start.
        memory = open_memory(workdir / "memory", embedder=None)
        # The event log, so the dashboard can reopen a run or a conversation the
        # bridge's window has let go.
        events = EventLog(workdir / "events")
        stack.callback(events.close)
        bridge = Bridge(config, registry, ScriptedProvider(DEMO_SCRIPT), memory, None, events)
        try:
            bridge.start()
        except Exception as e:
            raise DemoError(f"the bridge did not start: {e}") from e
        stack.callback(bridge.stop)
        print(
            f"bridge: connected as {creds[BRIDGE_USER].user or '(anonymous)'}, scripted model",
            file=out,
        )
        page = None if args.no_http else _serve_dashboard(stack, bridge, registry, args.http, out)

        settings = {
            "device": device,
            "host": host,
            "port": port,
            "user": creds[device].user or device,
            "password": creds[device].password,
            "prefix": PREFIX,
        }
        flash_dir = workdir / "boards" / device
        board = VirtualBoard(flash_dir, heap=args.heap, force_cpython=args.cpython)
        try:
            _check_romfs(args)
            flash = lay_out_flash(
                board.flash, settings, mpy=board.runs_mpy(not args.py), romfs=args.romfs
            )
        except BoardError as e:
            raise DemoError(str(e)) from e
        notice = fallback_notice()
        if notice and not args.cpython:
            print(notice, file=out)
        # Its stop registered first: Ctrl-C just after the start must not leave it running
        # (it has a session of its own, so the terminal's Ctrl-C does not reach it).
        stack.callback(board.stop)
        try:
            board.start()
        except OSError as e:
            raise DemoError(f"the virtual board did not start: {e}") from e
        console = BoardConsole(board, out)
        threading.Thread(target=console.pump, daemon=True).start()
        runtime = "MicroPython unix port" if board.runtime == "micropython" else "CPython"
        heap = f", heap {args.heap}" if board.runtime == "micropython" else ""
        kind = ".mpy" if board.runs_mpy(not args.py) else ".py"
        if args.romfs:
            kind = "the runtime in romfs.img (the heap is beyond it), its"
        print(
            f"board: {device} on {runtime}{heap}, {kind} files in {flash}"
            f" (pid {board.proc.pid if board.proc else '?'})",
            file=out,
        )
        _wait(
            lambda: bridge.hello(device) is not None,
            START_TIMEOUT_S,
            "waiting for the board's hello",
            board,
        )

        host_creds = creds[HOST_USER]
        client = HostClient(
            host,
            port,
            TENANT,
            username=host_creds.user,
            password=host_creds.password,
            prefix=PREFIX,
        )
        try:
            client.connect(timeout=START_TIMEOUT_S)
        except Exception as e:
            raise DemoError(f"the host client did not connect: {e}") from e
        stack.callback(client.close)
        secret = registry.tenant_secret(TENANT)
        assert secret is not None
        token = sign(bytes.fromhex(secret), TENANT, "demo-user")
        print("host: terminal view connected; sending the request\n", file=out)

        def ask(text: str) -> int:
            view = LiveView(out)
            # The view is drawn from paho's thread as events come, and once more from
            # here when the run has ended: one at a time, so the last status line is
            # always out before the next prompt.
            drawing = threading.Lock()

            def show(_event: dict[str, Any], snap: Any) -> None:
                # The client's snapshot, not the event into a second reducer: the client
                # may step over a hole the bridge declared lost, which a reducer fed
                # only the applied events would wait on for ever.
                with drawing:
                    view.show(snap)

            console.hold()
            client.on_event = show
            req = client.request(device, token, text)
            snap = None
            try:
                snap = _wait_run(client, req, board)
            finally:
                client.on_event = None
                with drawing:
                    if snap is not None:
                        view.show(snap)  # draws only what the callbacks have not
                    view.close()
                console.release()
            count = sum(1 for e in client.events if e.get("r") == snap.run)
            # An answer with events missing is not a finished answer.
            return_code = 0 if snap.status == "done" and snap.complete else 1
            if args.once:
                print("\n--- transcript ---", file=out)
                print_transcript(snap, out)
                print(f"events: {count} (run {snap.run}, ids 1..{snap.last_id})", file=out)
            elif page is not None:
                # Where the run is on the dashboard (the page opened by the link above
                # keeps its sign-in for the tab).
                print(f"on the dashboard: {page}#/run/{device}/{snap.run}", file=out)
            return return_code

        code = ask(args.ask)
        if args.once:
            for text in MEMORY_REQUESTS:
                print(f"\nhost: {text}\n", file=out)
                code = max(code, ask(text))
            return code
        print(
            "\nType another request (empty line or Ctrl-D to quit); try "
            f"{MEMORY_REQUESTS[0]!r}, then {MEMORY_REQUESTS[1]!r}.",
            file=out,
        )
        while True:
            try:
                text = input("you> ").strip()
            except EOFError:
                break
            if not text:
                break
            ask(text)
        return 0


def run_board(args: argparse.Namespace) -> int:
    host, port = args.broker or ("127.0.0.1", 1883)
    flash = args.flash or Path(".wren/boards") / args.device
    settings: dict[str, Any] = {
        "device": args.device,
        "host": host,
        "port": port,
        "user": args.user or args.device,
        "password": args.password,
        "prefix": PREFIX,
    }
    board = VirtualBoard(flash, heap=args.heap, force_cpython=args.cpython)
    try:
        main_py = args.main.read_text() if args.main else MAIN_PY
    except OSError as e:
        raise DemoError(f"cannot read the board's main.py: {e}") from e
    try:
        _check_romfs(args)
        lay_out_flash(
            flash, settings, mpy=board.runs_mpy(not args.py), main_py=main_py, romfs=args.romfs
        )
    except BoardError as e:
        raise DemoError(str(e)) from e
    notice = fallback_notice()
    if notice and not args.cpython:
        print(notice, flush=True)
    proc = board.start()
    print(
        f"board: {args.device} on {board.runtime} (heap {args.heap}), flash {flash},"
        f" broker {host}:{port}",
        flush=True,
    )
    try:
        while True:
            assert proc.stdout is not None
            console = Console()
            for line in proc.stdout:
                sys.stdout.writelines(console.feed(line))
                sys.stdout.flush()
            if proc.wait() != 0 and console.fatal_memory_error():
                # Not the traceback of an import: what to pass, in one line.
                raise DemoError(out_of_heap(args.heap, args.py))
            sys.stdout.writelines(console.flush())
            # A board that reset itself (its heap could not recover) boots again.
            if not board.reset_itself():
                break
            proc = board.start()
            print(f"board: {args.device} reset itself; started again", flush=True)
    finally:
        board.stop()
    return proc.returncode or 0


def run_ask(args: argparse.Namespace) -> int:
    # TLS as the bridge takes it (--broker-tls, --broker-ca, --broker-cert, --broker-key):
    # a host of a cloud broker connects on its TLS port, a client certificate where the
    # broker asks for one.
    try:
        tls = broker_tls(args)
    except ServiceError as e:
        raise DemoError(str(e)) from None
    host, port = args.broker or ("127.0.0.1", TLS_PORT if tls else 1883)
    registry = Registry(args.registry)
    secret = registry.tenant_secret(args.tenant)
    if secret is None:
        raise DemoError(f"tenant {args.tenant!r} is not in {args.registry}")
    try:
        token = sign(bytes.fromhex(secret), args.tenant, args.user_id)
    except ValueError as e:
        raise DemoError(f"--user-id: {e}") from None
    # With the token, the client reads its user's topic (and the device's), no one
    # else's runs (PROTOCOL.md "Who sees what"): what a host bound to that user may read.
    client = HostClient(
        host,
        port,
        args.tenant,
        username=args.user,
        password=args.password,
        prefix=PREFIX,
        token=token,
        tls=tls,
    )
    try:
        client.connect(timeout=10)
    except BrokerRefused as e:
        # Reached, and refused: not a broker that "cannot be reached".
        raise DemoError(f"{e} (--user/--password, or WREN_HOST_USER/WREN_HOST_PASSWORD)") from e
    except (HostConnectError, OSError, TimeoutError) as e:
        # Under TLS 1.3 a broker that wants a client certificate drops the connection
        # after the handshake, and the client is told nothing more: said as the likely
        # cause (the broker's log has the reason).
        hint = ""
        if tls is not None and tls.cert is None:
            hint = " (over TLS: if the broker asks for a client certificate, pass --broker-cert)"
        raise DemoError(f"cannot reach the broker at {host}:{port}: {e}{hint}") from e
    # connect() has read the bridge's retained status: with the bridge away, the request
    # would wait for it at the broker and run whenever it is back, unwatched. Not sent.
    bridge = client.bridge_presence()
    if bridge is not None and bridge.offline:
        client.close()
        raise DemoError(render_presence("the bridge", bridge))
    view = LiveView(sys.stdout)
    # Drawn from paho's thread as events come, and from here on Ctrl-C: one at a time.
    drawing = threading.Lock()
    # The request's id, known before it is sent: the client sees every run of the
    # tenant's devices (another host's, or one an earlier `wren ask` left running,
    # replayed to it by the bridge when it sees it mid-way), and only this request's
    # run is shown.
    req = secrets.token_hex(16)

    def show(_event: dict[str, Any], snap: Any) -> None:
        if snap.req == req:
            with drawing:
                view.show(snap)  # the client's snapshot (see run_demo's ask)

    client.on_event = show
    interrupts = _Interrupts()
    previous = interrupts.install()
    try:
        try:
            client.request(args.device, token, args.text, conv=args.conv, req=req)
            snap = _follow(client, req, args.timeout, args.device, interrupts.first)
        except KeyboardInterrupt:
            with drawing:
                view.close()  # an answer's open line
            return _cancel_on_interrupt(client, args.device, args.tenant, token, req, view, drawing)
    except RequestRefused as e:
        raise DemoError(render_refusal(args.device, args.tenant, e.kind, e.msg, e.detail)) from e
    except (HostConnectError, Unacknowledged) as e:
        # Not sent (it never will be), or not acknowledged (it may still run): said as such.
        raise DemoError(str(e)) from None
    except NeverConnected as e:
        raise DemoError(str(e)) from None
    except TimeoutError:
        raise DemoError(
            f"nothing from device {args.device} for {args.timeout:g} s "
            f"(the board, the bridge or the broker may be down)"
        ) from None
    finally:
        client.close()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    print()
    if not snap.complete:
        print(f"wren ask: {render_status(snap)}", file=sys.stderr)
    return 0 if snap.status == "done" and snap.complete else 1


# How often `wren ask` looks at the bridge's presence, and for a Ctrl-C, while it waits.
_CHECK_S = 0.1
# How long `wren ask` waits for a device the bridge has never seen online (its `presence`
# `unseen`) to show a run: a bridge that just started may not have read its status yet,
# but a device that never connected has no session at the broker to hold the request.
UNSEEN_WAIT_S = 10.0


class NeverConnected(TimeoutError):
    """No run of the request came within UNSEEN_WAIT_S, and the bridge had said it
    never saw the device online."""
# How long `wren ask` waits, after Ctrl-C, for its run to start (to have a run to cancel)
# and to end cancelled.
CANCEL_WAIT_S = 5.0


class _Interrupts:
    """`wren ask`'s SIGINT handler while it waits on its run.

    A KeyboardInterrupt raised wherever the main thread happens to be can land between
    a lock's acquisition and the `with` block that would release it (Condition's
    __enter__ is Python code): the host client's lock stayed taken, its network thread
    waited for it, and close() waited for that thread for ever (2 Ctrl-C in 137 of
    tests/test_ask_cancel.py's, under load). So the first Ctrl-C is only noted, and the wait raises
    KeyboardInterrupt where nothing is held (_follow); the second leaves at once, with
    the command line's `stopped` and exit 130, without the clean-up the first waits on.
    """

    def __init__(self) -> None:
        self.first = threading.Event()

    def install(self) -> Any:
        """Handle SIGINT; returns the handler to put back, None when SIGINT is not ours
        to handle (not the main thread: KeyboardInterrupt as before)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGINT, self)

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.first.is_set():
            self.first.set()
            return
        # Raw: the handler may run in the middle of one of the main thread's prints.
        os.write(2, b"\nstopped\n")
        os._exit(STOP_EXIT_CODE)


def _cancel_on_interrupt(
    client: HostClient,
    device: str,
    tenant: str,
    token: str,
    req: str,
    view: LiveView,
    drawing: threading.Lock,
) -> int:
    """Ctrl-C: cancel the request (its run, or, with none started yet, the request
    itself, which then never runs), wait up to CANCEL_WAIT_S for it to end, say what
    happened, exit 130. A second Ctrl-C leaves at once (the command line's `stopped`)."""
    print(
        f"\nwren ask: cancelling the run (waiting up to {CANCEL_WAIT_S:g} s; Ctrl-C again "
        "to leave now)",
        file=sys.stderr,
        flush=True,
    )
    reason = "stopped from wren ask"
    try:
        snap = client.cancel_request(device, token, req, reason, timeout=CANCEL_WAIT_S)
    except RequestRefused as e:
        if e.kind == "cancelled":
            line = "the request was cancelled before its run started: it will not run"
        else:
            line = render_refusal(device, tenant, e.kind, e.msg, e.detail) + "; nothing runs"
    except (HostConnectError, Unacknowledged) as e:
        line = f"{e}; the run may go on"
    except TimeoutError:
        line = (
            f"the board had not answered the cancel after {CANCEL_WAIT_S:g} s: the "
            "request may still run"
        )
    else:
        with drawing:
            view.show(snap)  # what the callbacks have not drawn yet: its status line
            view.close()
        if snap.status == "cancelled":
            line = "the run was cancelled"
        else:
            line = f"the run had ended before the cancel: {snap.status}"
    print(f"wren ask: {line}", file=sys.stderr, flush=True)
    return STOP_EXIT_CODE


def _follow(
    client: HostClient,
    req: str,
    timeout: float,
    device: str,
    interrupted: threading.Event | None = None,
) -> RunSnapshot:
    """Wait for the run of `req` to end; TimeoutError after `timeout` s without any event
    of it. The wait is for progress, not for the whole answer: a long answer that keeps
    streaming is never cut off (the timeout is longer than the bridge's own model
    timeout, so its error comes first). The bridge going offline meanwhile is a notice
    line on stderr, and the wait goes on: the board's events wait for the bridge at the
    broker, and the run may still end. So is the device's going offline past the
    bridge's grace (its `presence` event): a request sent within the grace waits for
    the board in its session. A device the bridge says it has never seen online is
    waited for UNSEEN_WAIT_S at most (NeverConnected), and the wait says so."""
    last = -1
    progress = time.monotonic()
    told: Presence | None = None
    told_device = False
    unseen_at: float | None = None  # when the bridge said it never saw the device

    def moved(x: RunSnapshot) -> bool:
        return x.terminal or x.last_id != last

    while True:
        if interrupted is not None and interrupted.is_set():
            raise KeyboardInterrupt  # a Ctrl-C noted by _Interrupts, raised where it is safe
        left = progress + timeout - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no event of request {req} for {timeout} s")
        try:
            snap = client.wait_for(req, moved, timeout=min(_CHECK_S, left))
        except TimeoutError:
            bridge = client.bridge_presence()
            if bridge is not None and bridge.offline and told is None:
                notice = f"{render_presence('the bridge', bridge)}; waiting for it"
                print(f"\nwren ask: {notice} (at most {timeout:g} s without news)",
                      file=sys.stderr, flush=True)  # fmt: skip
                told = bridge
            elif told is not None and bridge is not None and not bridge.offline:
                print("wren ask: the bridge is back", file=sys.stderr, flush=True)
                told = None
            away = client.device_presence(device)
            if away is not None and away.offline and not told_device:
                notice = f"{render_presence(f'device {device}', away)}; the request waits for it"
                print(f"\nwren ask: {notice} (at most {timeout:g} s without news)",
                      file=sys.stderr, flush=True)  # fmt: skip
                told_device = True
            elif told_device and away is not None and not away.offline:
                print(f"wren ask: device {device} is back", file=sys.stderr, flush=True)
                told_device = False
            if away is not None and away.st == "unseen" and last < 0:
                grace = min(UNSEEN_WAIT_S, timeout)
                if unseen_at is None:
                    unseen_at = time.monotonic()
                    print(f"\nwren ask: waiting for device {device} to connect (it has never "
                          f"been seen online; at most {grace:g} s)", file=sys.stderr,
                          flush=True)  # fmt: skip
                elif time.monotonic() - unseen_at >= grace:
                    raise NeverConnected(
                        f"device {device} did not connect within {grace:g} s and has never "
                        "been seen online: nothing ran (start the board, then ask again)"
                    ) from None
            continue
        if told_device:
            # An event of the run: the board is back and at it.
            print(f"wren ask: device {device} is back", file=sys.stderr, flush=True)
            told_device = False
        if snap.terminal:
            return snap
        last = snap.last_id
        progress = time.monotonic()
