# A simulated `network` module: the station side of MicroPython's WLAN as a Pico W (rp2,
# cyw43) or an ESP32 reports it, for board tests on the unix port and CPython. Tests
# only: a test puts it in sys.modules["network"], or puts this folder ahead on a virtual
# board's MICROPYPATH; it is never on a board's flash.
#
# It plays one access point, the "world": whether it is there (`ap`), its `ssid` and
# `password`, how many status() polls a join takes (`polls`), the address it hands out
# (`ip`), and the port whose codes status() speaks (`port`: "rp2", the default, or
# "esp32"). `ap`, `password` and `polls` may be lists, read by join: the n-th connect()
# sees item n (the last one from then on), which scripts a boot: no access point twice,
# then there. A test in this process sets the world with configure(), and changes it
# under a station that keeps its state with change(). For a board in another process
# the test names a JSON file of the world in WREN_SIM_NETWORK, read again at every call,
# and changes the world while the board runs (the access point lost, and back) by
# writing the file again. No clock: a join ends after so many polls, whatever the time.
#
# What the ports do that a board must cope with, and the simulation does too:
# - rp2: a failed join's status() stays at its negative code until the next connect();
#   a network lost reads 0 (cyw43's link down, STAT_IDLE); config(reconnects=...) is
#   refused with ValueError.
# - esp32: the driver retries a failed join on its own and status() says
#   STAT_CONNECTING while it does, for good unless config(reconnects=n) bounds it; then
#   it says ESP-IDF's reason (201 no access point, 202 authentication failed, or the
#   world's `auth_reason`: a wrong WPA2 password often gives 15, the 4-way handshake's
#   timeout). connect() while the driver still tries raises OSError. A lost network is
#   retried the same way.
import json
import os

STA_IF = 0
AP_IF = 1

_CODES = {
    "rp2": {"STAT_IDLE": 0, "STAT_CONNECTING": 1, "STAT_GOT_IP": 3,
            "STAT_CONNECT_FAIL": -1, "STAT_NO_AP_FOUND": -2, "STAT_WRONG_PASSWORD": -3},
    "esp32": {"STAT_IDLE": 1000, "STAT_CONNECTING": 1001, "STAT_GOT_IP": 1010,
              "STAT_BEACON_TIMEOUT": 200, "STAT_NO_AP_FOUND": 201, "STAT_WRONG_PASSWORD": 202,
              "STAT_ASSOC_FAIL": 203, "STAT_HANDSHAKE_TIMEOUT": 204},
}

# What the board did, for the tests: connect() and disconnect() calls, status() polls.
stats = {"joins": 0, "disconnects": 0, "polls": 0}
_world = {}
_port = [None]  # the port whose STAT_ constants this module holds now
# The station: on, the join asked for (ssid, password) or None, polls since connect(),
# joined, the ESP32 driver's tries of this join, its last reason, its try bound.
_radio = {}


def configure(**world):
    # A new world and a station that has done nothing yet.
    global _world
    _world = world
    for k in stats:
        stats[k] = 0
    _radio.clear()
    _radio.update(on=False, want=None, n=0, up=False, tries=0, reason=0, bound=0)
    _read()


def change(**world):
    # The world changes under a station that keeps its state (joined, or trying).
    _world.update(world)


def _read():
    path = os.getenv("WREN_SIM_NETWORK") if hasattr(os, "getenv") else None
    if path:
        with open(path) as f:
            w = json.load(f)
    else:
        w = _world
    port = w.get("port", "rp2")
    if port != _port[0]:
        # The port's constants, and only those: an rp2 has no STAT_BEACON_TIMEOUT.
        g = globals()
        for k in _CODES["esp32"]:
            g.pop(k, None)
        for k in _CODES["rp2"]:
            g.pop(k, None)
        g.update(_CODES[port])
        _port[0] = port
    return w


configure()


def _at(w, key, default):
    v = w.get(key, default)
    if isinstance(v, list):
        return v[min(max(stats["joins"] - 1, 0), len(v) - 1)]
    return v


def _outcome(w):
    # None when the join asked for would succeed in this world, else the STAT_ name of
    # why not.
    ssid, password = _radio["want"]
    if not _at(w, "ap", True) or ssid != w.get("ssid", "wren-lab"):
        return "STAT_NO_AP_FOUND"
    if password != _at(w, "password", None):
        return "STAT_WRONG_PASSWORD"
    return None


def _lose():
    _radio["up"] = False
    if _port[0] == "rp2":
        _radio["want"] = None
    else:
        _radio["n"] = _radio["tries"] = 0  # the ESP32's driver tries again


class WLAN:
    IF_STA = STA_IF
    IF_AP = AP_IF

    def __init__(self, interface=STA_IF):
        if interface != STA_IF:
            raise ValueError("the simulation has a station only")

    def active(self, on=None):
        if on is not None:
            _radio["on"] = bool(on)
            if not on:
                _radio["want"] = None
                _radio["up"] = False
        return _radio["on"]

    def config(self, *args, **kw):
        _read()
        if "reconnects" in kw:
            if _port[0] == "rp2":
                raise ValueError("unknown config param")
            _radio["bound"] = kw["reconnects"]
        if args:
            want = _radio["want"]
            return {"essid": want and want[0], "mac": b"\x02\0\0\0\0\x01"}[args[0]]
        return None

    def connect(self, ssid=None, password=None, bssid=None):
        _read()
        if not _radio["on"]:
            raise OSError(1)  # EPERM: the station is not active
        if _port[0] == "esp32" and _radio["want"] is not None and not _radio["up"]:
            raise OSError("Wifi Internal Error")
        stats["joins"] += 1
        _radio.update(want=(ssid, password), n=0, up=False, tries=0, reason=0)

    def disconnect(self):
        stats["disconnects"] += 1
        _radio["want"] = None
        _radio["up"] = False

    def isconnected(self):
        w = _read()
        if _radio["up"] and _outcome(w) is not None:
            _lose()
        return _radio["up"]

    def status(self, param=None):
        w = _read()
        codes = _CODES[_port[0]]
        if param is not None:
            if param != "rssi":
                raise ValueError("unknown status param")
            return -50
        if _radio["up"]:
            if _outcome(w) is None:
                return codes["STAT_GOT_IP"]
            _lose()
        if _radio["want"] is None:
            return _radio["reason"] or codes["STAT_IDLE"]
        stats["polls"] += 1
        _radio["n"] += 1
        if _radio["n"] <= _at(w, "polls", 1):
            return codes["STAT_CONNECTING"]
        why = _outcome(w)
        if why is None:
            _radio["up"] = True
            return codes["STAT_GOT_IP"]
        if _port[0] == "rp2":
            return codes[why]
        _radio["tries"] += 1
        _radio["n"] = 0
        if _radio["bound"] and _radio["tries"] >= _radio["bound"]:
            code = codes[why]
            if why == "STAT_WRONG_PASSWORD":
                code = w.get("auth_reason", code)
            _radio["want"] = None
            _radio["reason"] = code
            return code
        return codes["STAT_CONNECTING"]

    def ifconfig(self, *args):
        ip = _read().get("ip", "10.0.0.2") if _radio["up"] else "0.0.0.0"
        return (ip, "255.255.255.0", "10.0.0.1", "10.0.0.1")
