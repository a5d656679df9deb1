# The board's machine at start-up, for a board whose settings name a Wi-Fi network
# (`wifi`: ssid, password) or a watchdog (`wdt_ms`): the watchdog is fed while the
# board's scheduler turns, the network is joined with a bounded, jittered backoff and one
# log line per failed join (its reason and the wait before the next), and it is joined
# again when the link, about to dial the broker, finds it gone (start() sets the link's
# hook). Its own module, loaded only then: the unix port and CPython are already
# on a network, and on a small heap every module loaded costs its code and its names
# (this one 3.0 KiB of a 32-bit board's heap, from .mpy, and 0.7 more once joined).
from edge_runtime import platform

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_POLL_MS = const(200)  # how often a join looks at the station's status
# One join, from connect() to an address, unless the settings say (`try_ms`): a Pico W
# takes a few seconds with DHCP; an ESP32 gives up on its own first (_RETRIES).
_TRY_MS = const(20000)
# How many times an ESP32's driver tries a join before status() says why it failed;
# left unlimited (the port's default) it says "connecting" for as long as it retries.
_RETRIES = const(3)
_BACKOFF = (1000, 30000)  # the wait between joins, least and most, unless told
_FEEDS = const(4)  # watchdog feeds per period: three in a row may come late
# ESP-IDF's reason code for a WPA 4-way handshake that timed out, which an ESP32 passes
# through status() with no constant naming it: what a wrong password usually gives.
_IDF_4WAY = const(15)

# The failures status() can name, by the port's own names (the codes differ: a Pico W's
# cyw43 gives -3..-1, an ESP32 passes ESP-IDF's reasons, 200 and up, and names only some
# of them). The log says the name, "STAT_NO_AP_FOUND" as "no ap found": the words of the
# port's documentation, and no text of ours on the heap.
_WHY = ("STAT_WRONG_PASSWORD", "STAT_NO_AP_FOUND", "STAT_CONNECT_FAIL", "STAT_BEACON_TIMEOUT",
        "STAT_ASSOC_FAIL", "STAT_HANDSHAKE_TIMEOUT")

# The station, the network module, the `wifi` settings and the board's link, once
# start() found them.
_on = []


def _positive(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _check(settings):
    # Settings that cannot work are refused by name at boot, not retried for good (the
    # values are not said: one is a password).
    wifi = settings.get("wifi")
    bad = None
    if wifi:
        b = wifi.get("backoff_ms", (1, 1)) if isinstance(wifi, dict) else None
        if not isinstance(wifi, dict) or not isinstance(wifi.get("ssid"), str) or not wifi["ssid"]:
            bad = 'wifi must be {"ssid": ..., "password": ...}'
        elif not _positive(wifi.get("try_ms", 1)):
            bad = "wifi try_ms must be a positive int"
        elif not (isinstance(b, (list, tuple)) and len(b) == 2 and _positive(b[0])
                  and _positive(b[1]) and b[0] <= b[1]):
            bad = "wifi backoff_ms must be [least, most] in ms"
    if not _positive(settings.get("wdt_ms", 1)):
        bad = "wdt_ms must be a positive int"
    if bad:
        raise ValueError("settings: " + bad)


async def _feed(wdt, ms):
    # While this task gets its turns the board is not wedged: a blocking call that never
    # returns, or a scheduler that stopped, leaves the watchdog unfed and it resets the
    # board. Each wait on the board is bounded well under a watchdog's period.
    while True:
        wdt.feed()
        await platform.sleep_ms(ms // _FEEDS)


def _code(network, name):
    # A status constant: on the module (every port today) or its WLAN class; None where
    # the port has none.
    v = getattr(network, name, None)
    return getattr(network.WLAN, name, None) if v is None else v


def _why(network, st):
    # Why a join failed, from status(); None while it is still under way.
    for name in _WHY:
        if st == _code(network, name):
            return name[5:].replace("_", " ").lower()
    # cyw43's failures are all negative. A port whose own states start at 1000 (ESP32)
    # gives any code below them as ESP-IDF's reason for the failure.
    idle = _code(network, "STAT_IDLE") or 0
    if st == _IDF_4WAY and idle >= 1000:
        return "handshake timeout"
    if st < 0 or st < idle:
        return "failed"
    return None


async def _join(sta, network, wifi):
    # One join, bounded: None once the station has an address, else why not.
    if sta.isconnected():  # a soft reset keeps the radio joined
        return None
    try:
        sta.active(True)
        try:
            # An ESP32 still retrying a network it lost refuses a new connect().
            sta.disconnect()
        except OSError:
            pass
        sta.connect(wifi["ssid"], wifi.get("password"))
    except OSError as e:
        return "the radio refused: %r" % (e,)
    start = platform.ticks_ms()
    ms = wifi.get("try_ms", _TRY_MS)
    while True:
        await platform.sleep_ms(_POLL_MS)
        st = sta.status()
        if sta.isconnected():
            return None
        why = _why(network, st)
        if why is None and platform.ticks_diff(platform.ticks_ms(), start) >= ms:
            why = "no address after %d ms" % ms
        if why:
            try:
                sta.disconnect()  # the driver stops retrying until the next join
            except OSError:
                pass
            return "%s (status %d)" % (why, st)


async def _up():
    # Joins until the station has an address, or until the link stops (board.py's reset
    # path must not wait for an access point to come back).
    sta, network, wifi, link = _on
    lo, hi = wifi.get("backoff_ms", _BACKOFF)
    fails = 0
    while not (link and link._stopping):
        why = await _join(sta, network, wifi)
        if why is None:
            try:
                addr = sta.ifconfig()[0]
            except (AttributeError, OSError):  # a port with ipconfig() only
                addr = "?"
            platform.log("wifi: joined %r as %s%s" % (
                wifi["ssid"], addr, " after %d failed joins" % fails if fails else ""))
            return
        # Doubling from the least to the most, half of it random (as the link's): boards
        # that lost the same access point do not come back in lockstep.
        d = min(lo << min(fails, 16), hi) // 2
        try:
            from random import getrandbits
            d += getrandbits(30) % (d + 1)
        except ImportError:
            d += platform.ticks_ms() % (d + 1)
        fails += 1
        wait = "%d ms" % d if d < 1000 else "%d.%d s" % (d // 1000, d % 1000 // 100)
        platform.log("wifi: %r: %s; next try in %s" % (wifi["ssid"], why, wait))
        await platform.sleep_ms(d)


async def start(settings, link=None):
    # At boot, before `link` dials: the watchdog, then the network (returns once
    # joined), and the link's hook to join it again.
    _check(settings)
    ms = settings.get("wdt_ms")
    if ms:
        try:
            from machine import WDT
            platform.asyncio.create_task(_feed(WDT(timeout=ms), ms))
            platform.log("watchdog: %d ms" % ms)
        except Exception as e:  # no machine (CPython), no WDT (the unix port), ms out of range
            platform.log("no watchdog (%r); wdt_ms %d is not kept" % (e, ms))
    wifi = settings.get("wifi")
    if not wifi:
        return
    try:
        import network
    except ImportError:
        platform.log("no network module on this port; using the host's network")
        return
    sta = network.WLAN(network.STA_IF)
    try:
        sta.active(True)
        sta.config(reconnects=_RETRIES)
    except (ValueError, TypeError, OSError):  # a Pico W's cyw43 has no such setting
        pass
    _on[:] = [sta, network, wifi, link]
    await _up()
    if link:
        link.wifi = connect


async def connect():
    # The link's hook before each dial: at once while the station has its address; when
    # it lost it (the access point went away), one line says so and the network is
    # joined again before the link dials the broker.
    if not _on or _on[0].isconnected():
        return
    platform.log("wifi: %r lost (status %d); joining again" % (_on[2]["ssid"], _on[0].status()))
    await _up()
