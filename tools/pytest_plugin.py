"""Hardware-in-the-loop tests of your own Wren agent, with pytest.

Installed with Wren (the `pytest11` entry point `wren`), so its fixtures are there in
any pytest run; `-p wren` loads it where plugins are not loaded by themselves
(PYTEST_DISABLE_PLUGIN_AUTOLOAD). A test of an agent:

    def test_it_reads_the_sensor(wren_board, wren_host):
        run = wren_host.ask(wren_board.device, "How warm is it?")
        assert run.status == "done" and "°C" in run.text

Fixtures (all named `wren_*`; tools/hil_lab.py has the parts they hand out):
- `wren_broker`: Mosquitto of the session's own, on a free port, with Wren's password
  file and ACL (`wren_lab` has its users).
- `wren_bridge`: the real bridge (`python -m server_bridge`) with the scripted model
  (`--wren-script FILE`, default the demo's script) or an OpenAI-compatible server
  (`--wren-model-url URL --wren-model NAME`, its key in $OPENAI_API_KEY); started once
  and kept while the tests ask for the same model and agent.
- `wren_board`: your agent (`--wren-agent PATH`: its main.py, or a directory with main.py
  and its other modules; default the demo thermostat) booted on `--wren-target`, online
  when the test begins and stopped after it. Its files are what `wren build` makes of
  the agent (`--wren-build-target`, default unix) and the settings the lab writes:
  `unix` (default) runs them on the MicroPython unix port at `--wren-heap` (default
  128K); `pty` on the unix port behind a pseudo-terminal (tools/pty_board.py), a blank
  board each test, copied to it by `wren flash`; `serial:PORT` on a real board at that
  port (or any port mpremote takes, such as `socket://HOST:PORT`), copied by `wren
  flash` once a session (only what changed), and soft-reset for each test. A real board
  reaches the broker over Wi-Fi: give `--wren-broker-host` an address of this machine
  it can reach, and its Wi-Fi in `--wren-settings FILE` (JSON merged into its
  settings.json, checked as `wren flash` checks it). `--wren-code romfs` puts the
  runtime and the agent in a ROMFS image instead (`wren build --romfs`), as a board whose
  firmware has a ROMFS partition holds them: the `pty` board gets such a partition, and
  `--wren-heap` is then the heap beyond the image.
- `wren_host`: a host client signed in with a session token: `ask`, `request`,
  `wait`, `wait_tool` and `answer` (a client tool answered from the test), `on_tool`.

`wren_board` also reboots (`reboot()`), waits for presence (`wait_online()`), reads
the free heap the board reported (`min_free_heap()`), its console (`console`,
`wait_console()`) and how long its last boot took to presence (`boot_s`).
`@pytest.mark.wren_heap("96K")` runs one test's board at another heap (unix and pty).
Each option may also be set in the pytest configuration file, as `wren_target`,
`wren_agent`, ... (paths there are relative to that file). A test module can override
the fixtures `wren_target`, `wren_agent` and `wren_model` (to run on several targets,
say: a fixture of the same name with `params`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tools.broker import MosquittoProcess
    from tools.hil_lab import Agent, Board, BridgeProcess, Host, Lab, Model, Target

# option name (without --wren-) -> (help, default). Each is also an ini key wren_<name>.
_OPTIONS: dict[str, tuple[str, str | None]] = {
    "target": ("where the board runs: unix, pty or serial:PORT (default unix)", None),
    "agent": ("the board's main.py, or a directory with it (default: the demo thermostat)", None),
    "heap": ("the unix port's heap for the board, unix and pty targets (default 128K)", None),
    "script": ("the scripted model's script, a JSON file (default: the demo's)", None),
    "model-url": ("an OpenAI-compatible server for the bridge instead of a script", None),
    "model": ("the model to ask that server for (default gpt-4o-mini)", None),
    "api-key-env": ("the environment variable with that server's key (default OPENAI_API_KEY)",
                    None),
    "micropython": ("the MicroPython unix port to run (default: the installed one)", None),
    "broker-host": ("the address the broker listens on and the board connects to "
                    "(default 127.0.0.1; a board on Wi-Fi needs one it can reach)", None),
    "settings": ("a JSON file merged into the board's settings.json (Wi-Fi, say)", None),
    "build-target": ("what `wren build` compiles for: esp32, esp32s3, rp2 or unix (default "
                     "unix; it matters only to an agent's native code)", None),
    "code": ("where the board holds the runtime and the agent: flash (.mpy on its file "
             "system, the default) or romfs (a ROMFS image, `wren build --romfs`: the heap "
             "is then the heap beyond it; a serial board's firmware needs a ROMFS partition)",
             None),
    "timeout": ("seconds a run may take in wren_host.ask (default 60)", None),
}  # fmt: skip
# Options that name files: relative to the configuration file when set there.
_PATHS = {"agent", "script", "micropython", "settings"}


# Imported as they are written, not assertion-rewritten. pytest marks for rewriting every
# package of a distribution that ships a plugin, here the board runtime and the bridge
# (every package, from a checkout's egg-info): rewritten, a board module is not the code
# a board runs, and CPython 3.11.7 fails to parse any module first imported after a
# RecursionError in the AST code of the same process ("AST constructor recursion depth
# mismatch"), which the suite met importing edge_runtime.wifi late. The marks are
# pytest's own, with no public way to take one back: where they are not the set this
# expects, nothing changes.
_AS_WRITTEN = ("edge_runtime", "server_bridge")


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    marked = getattr(getattr(pluginmanager, "rewrite_hook", None), "_must_rewrite", None)
    if isinstance(marked, set):
        marked.difference_update(_AS_WRITTEN)
    group = parser.getgroup("wren", "Wren hardware-in-the-loop")
    for name, (text, default) in _OPTIONS.items():
        key = "wren_" + name.replace("-", "_")
        group.addoption(f"--wren-{name}", dest=key, default=default, help=text)
        parser.addini(key, text, default=None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "wren_heap(size): the heap of this test's board on the unix port (e.g. 96K)"
    )
    target = _option(config, "target")
    if target is not None:
        # A wrong target is a usage error at once, not a failure in every test.
        from tools.hil_lab import Target as _Target
        from tools.hil_lab import TargetError

        try:
            _Target.parse(target)
        except TargetError as e:
            raise pytest.UsageError(str(e)) from None
    code = _option(config, "code")
    if code is not None:
        from tools.hil_lab import CODES

        if code not in CODES:
            raise pytest.UsageError(f"--wren-code {code!r}: use {' or '.join(CODES)}")


def pytest_report_header(config: pytest.Config) -> str | None:
    if not any(_option(config, name) for name in ("target", "agent", "script", "model-url")):
        return None
    shown = ", ".join(
        f"{name} {value}"
        for name in ("target", "agent", "heap", "script", "model-url")
        if (value := _option(config, name)) is not None
    )
    return f"wren: {shown}"


def _option(config: pytest.Config, name: str) -> str | None:
    """An option from the command line, else the configuration file, else None."""
    key = "wren_" + name.replace("-", "_")
    value = config.getoption(key)
    if value is not None:
        return str(value)
    ini = config.getini(key)
    if not ini:
        return None
    if name in _PATHS and config.inipath is not None:
        return str(config.inipath.parent / str(ini))
    return str(ini)


# --- what the tests run against (overridable) --------------------------------------------


@pytest.fixture(scope="session")
def wren_target(pytestconfig: pytest.Config) -> Target:
    """Where the board runs (`--wren-target`)."""
    from tools.hil_lab import Target

    return Target.parse(_option(pytestconfig, "target") or "unix")


@pytest.fixture(scope="session")
def wren_agent(pytestconfig: pytest.Config) -> Agent:
    """The agent the board runs (`--wren-agent`)."""
    from tools.hil_lab import Agent

    path = _option(pytestconfig, "agent")
    return Agent() if path is None else Agent.at(Path(path))


@pytest.fixture(scope="session")
def wren_model(pytestconfig: pytest.Config) -> Model:
    """What the bridge answers model calls with (`--wren-script`, `--wren-model-url`)."""
    from tools.hil_lab import Model

    script = _option(pytestconfig, "script")
    return Model(
        script=Path(script) if script else None,
        url=_option(pytestconfig, "model-url"),
        name=_option(pytestconfig, "model") or Model.name,
        api_key_env=_option(pytestconfig, "api-key-env") or Model.api_key_env,
    )


@pytest.fixture
def wren_heap(request: pytest.FixtureRequest) -> str:
    """The board's heap on the unix port: the test's `wren_heap` mark, else
    `--wren-heap`, else 128K."""
    mark = request.node.get_closest_marker("wren_heap")
    if mark is not None:
        if len(mark.args) != 1 or not isinstance(mark.args[0], str):
            raise pytest.UsageError('wren_heap takes one size, e.g. @pytest.mark.wren_heap("96K")')
        return str(mark.args[0])
    return _option(request.config, "heap") or "128K"


# --- the parts ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def wren_lab(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lab]:
    """The session's lab: its broker, the bridge it runs, its users (tools/hil_lab.py)."""
    from tools.hil_lab import Lab

    settings: dict[str, Any] = {}
    path = _option(pytestconfig, "settings")
    if path is not None:
        try:
            loaded = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise pytest.UsageError(f"--wren-settings {path}: {e}") from None
        if not isinstance(loaded, dict):
            raise pytest.UsageError(f"--wren-settings {path}: not a JSON object")
        settings = loaded
    lab = Lab(
        tmp_path_factory.mktemp("wren-hil"),
        broker_host=_option(pytestconfig, "broker-host") or "127.0.0.1",
        settings=settings,
        build_target=_option(pytestconfig, "build-target") or "unix",
        code=_option(pytestconfig, "code") or "flash",
    )
    yield lab
    lab.close()


@pytest.fixture(scope="session")
def wren_broker(wren_lab: Lab) -> MosquittoProcess:
    """The session's Mosquitto (`host`, `port`, `address`, `log()`)."""
    return wren_lab.broker


@pytest.fixture
def wren_bridge(wren_lab: Lab, wren_model: Model, wren_agent: Agent) -> BridgeProcess:
    """The bridge, running with `wren_model` for a device of `wren_agent`."""
    return wren_lab.bridge(wren_model, wren_agent.name)


@pytest.fixture
def wren_board(
    request: pytest.FixtureRequest,
    wren_lab: Lab,
    wren_bridge: BridgeProcess,
    wren_target: Target,
    wren_agent: Agent,
    wren_heap: str,
) -> Iterator[Board]:
    """The board, booted with the agent and online; stopped after the test."""
    board = wren_lab.board(
        wren_target, wren_agent, wren_heap, _option(request.config, "micropython")
    )
    yield board
    board.stop()


@pytest.fixture
def wren_host(
    request: pytest.FixtureRequest, wren_lab: Lab, wren_bridge: BridgeProcess
) -> Iterator[Host]:
    """A host client with a session token; closed after the test."""
    timeout = _option(request.config, "timeout") or "60"
    try:
        seconds = float(timeout)
    except ValueError:
        raise pytest.UsageError(f"--wren-timeout {timeout!r}: not a number of seconds") from None
    host = wren_lab.host(seconds)
    yield host
    host.close()
