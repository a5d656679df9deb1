# A board's start-up on its machine (wifi.py): joining Wi-Fi with a bounded, jittered
# backoff and one log line per failed join with its reason, joining again when the link
# finds the network gone, and the watchdog fed while the scheduler turns. On CPython and
# the unix port, against the simulated network and machine of firmware_tests/sim, each
# put in sys.modules for the test and taken out after (on a real board too, so a test
# never joins its Wi-Fi or starts its watchdog). Deterministic by the simulation's
# script: a join ends after so many status polls, not after so long.
import sys

from edge_runtime import platform
from edge_runtime.link import Link
from firmware_tests.sim import machine as simmachine
from firmware_tests.sim import network as simnet
from firmware_tests.support import raises, run

SSID = "wren-lab"
# Short waits between joins: the backoff's size is not what these tests are about.
WIFI = {"ssid": SSID, "password": "s3cret", "backoff_ms": [20, 40]}


# Each simulated start-up takes a second or two; a board that does not join in this long
# never will.
_BOUND_MS = 30000


class _NoWDT:
    # A port's machine module without a watchdog (the unix port's has none either).
    pass


def _board(world, body, settings=None, machine=simmachine):
    # Runs body(wifi) with the simulated network (in `world`) and `machine` as the port's
    # modules -> the lines the board logged (each also printed, as a board's console).
    # Each line also notes how often the watchdog had been fed when it was said.
    lines = []
    said = platform.log

    def log(*parts):
        line = " ".join(str(p) for p in parts)
        lines.append((line, simmachine.wdts[-1].feeds if simmachine.wdts else 0))
        said(*parts)

    before = {k: sys.modules.get(k) for k in ("network", "machine")}
    sys.modules["network"] = simnet
    sys.modules["machine"] = machine
    simnet.configure(**world)
    del simmachine.wdts[:]
    platform.log = log
    from edge_runtime import wifi
    wifi._on[:] = []  # what an earlier test's board joined
    try:
        # Bounded: a board that never joins fails the test instead of hanging it.
        run(platform.wait_for_ms(body(wifi, settings if settings is not None else {"wifi": WIFI}),
                                 _BOUND_MS))
    finally:
        platform.log = said
        for k in before:
            if before[k] is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = before[k]
    return lines


async def _start(wifi, settings):
    await wifi.start(settings)


def _said(lines, start):
    return [line for line, _ in lines if line.startswith(start)]


def _fail_line(why, status):
    return "wifi: '%s': %s (status %d); next try in " % (SSID, why, status)


def test_a_board_with_no_access_point_says_so_once_per_join_and_joins_when_it_comes():
    # Pico W codes: cyw43's -2 for no network.
    lines = _board({"ssid": SSID, "password": "s3cret", "ap": [False, False, True],
                    "ip": "10.0.0.7"}, _start)
    fails = _said(lines, "wifi: '%s': " % SSID)
    assert len(fails) == 2, lines
    for line in fails:
        assert line.startswith(_fail_line("no ap found", -2)), line
        assert line.endswith(" ms"), line  # backoff_ms [20, 40]
    assert _said(lines, "wifi: joined") == ["wifi: joined '%s' as 10.0.0.7 after 2 failed joins"
                                            % SSID], lines
    assert len(lines) == 3, lines
    assert simnet.stats["joins"] == 3


def test_a_wrong_password_is_said_with_each_failed_join_until_the_access_point_takes_it():
    # The access point's password changes to the board's at the third join (a user who
    # fixed the access point): two failures, each said once.
    lines = _board({"ssid": SSID, "password": ["other", "other", "s3cret"]}, _start)
    fails = _said(lines, "wifi: '%s': " % SSID)
    assert len(fails) == 2, lines
    for line in fails:
        assert line.startswith(_fail_line("wrong password", -3)), line
    assert _said(lines, "wifi: joined")[0].endswith("after 2 failed joins"), lines


def test_an_esp32_says_why_a_join_failed_because_the_board_bounds_its_driver_retries():
    # Left to its default, an ESP32's driver retries for good and status() says
    # "connecting" all along; the board bounds the retries (config reconnects), so the
    # join ends with ESP-IDF's reason: 201 no access point, 202 authentication failed, 15
    # a 4-way handshake that timed out, which no constant of the port names.
    # (A try of the driver's in one status poll: `polls` 0.)
    world = {"port": "esp32", "polls": 0, "ssid": SSID, "ap": [False, True, True, True],
             "password": ["s3cret", "other", "other", "s3cret"]}
    lines = _board(dict(world), _start)
    fails = _said(lines, "wifi: '%s': " % SSID)
    assert [f[:f.index(";")] for f in fails] == [
        "wifi: '%s': no ap found (status 201)" % SSID,
        "wifi: '%s': wrong password (status 202)" % SSID,
        "wifi: '%s': wrong password (status 202)" % SSID], lines
    assert _said(lines, "wifi: joined")[0].endswith("after 3 failed joins"), lines
    world["auth_reason"] = 15
    world["ap"] = True
    world["password"] = ["other", "s3cret"]
    fails = _said(_board(world, _start), "wifi: '%s': " % SSID)
    assert len(fails) == 1 and fails[0].startswith(
        _fail_line("handshake timeout", 15)), fails


def test_a_join_that_never_ends_is_bounded_and_said():
    # A driver that says "connecting" for good (here the first join's): the join ends
    # after try_ms with what status() said last.
    settings = {"wifi": dict(WIFI, try_ms=300)}
    lines = _board({"ssid": SSID, "password": "s3cret", "polls": [10 ** 6, 1]}, _start, settings)
    fails = _said(lines, "wifi: '%s': " % SSID)
    assert len(fails) == 1 and fails[0].startswith(
        _fail_line("no address after 300 ms", 1)), lines
    assert simnet.stats["disconnects"] >= 2  # the hung join was ended before the next


def _lost_and_back(port, lost_status):
    async def body(wifi, settings):
        await wifi.start(settings)
        joined = simnet.stats["joins"]
        await wifi.connect()  # joined: the link dials at once
        assert simnet.stats["joins"] == joined
        # The access point goes, is not there for the next join, and is back for the
        # one after.
        simnet.change(ap=[False, False, True])
        await wifi.connect()

    lines = _board({"port": port, "ssid": SSID, "password": "s3cret"}, body)
    assert [line for line, _ in lines[1:]] == [
        "wifi: '%s' lost (status %d); joining again" % (SSID, lost_status),
        lines[2][0], "wifi: joined '%s' as 10.0.0.2 after 1 failed joins" % SSID], lines
    assert lines[2][0].startswith(_fail_line("no ap found",
                                             -2 if port == "rp2" else 201)), lines
    assert simnet.stats["joins"] == 3


def test_a_network_lost_while_the_board_runs_is_joined_again_before_the_link_dials():
    # Pico W: cyw43's link reads down (0) once the access point is gone.
    _lost_and_back("rp2", 0)


def test_an_esp32_still_retrying_a_lost_network_is_told_to_stop_before_it_joins_again():
    # An ESP32's driver retries a lost network on its own ("connecting", 1001), and
    # refuses a connect() meanwhile (OSError): the board disconnects it first.
    _lost_and_back("esp32", 1001)


def test_a_stopping_link_does_not_wait_for_the_network_to_come_back():
    link = Link("wifi-test", "127.0.0.1", 1, rx_size=256)

    async def body(wifi, settings):
        await wifi.start(settings, link)
        assert link.wifi is wifi.connect  # the hook the link awaits before each dial
        link.stop()  # as board.py's reset path does
        simnet.change(ap=False)
        await link.wifi()

    lines = _board({"ssid": SSID, "password": "s3cret"}, body)
    assert [line for line, _ in lines][1:] == ["wifi: '%s' lost (status 0); joining again" % SSID]
    assert simnet.stats["joins"] == 1


def test_the_watchdog_is_fed_while_the_board_waits_for_its_network():
    lines = _board({"ssid": SSID, "password": "s3cret", "ap": [False, True]}, _start,
                   {"wifi": WIFI, "wdt_ms": 40})
    assert len(simmachine.wdts) == 1 and simmachine.wdts[0].timeout == 40
    assert lines[0] == ("watchdog: 40 ms", 0), lines
    # Fed between the failed join's line and the joined line (a join's status polls wait
    # 200 ms, the feeds 10), and before either.
    (fail, fed), (joined, later) = lines[1:]
    assert fail.startswith(_fail_line("no ap found", -2)), lines
    assert joined.startswith("wifi: joined"), lines
    assert 0 < fed < later, lines


def test_a_port_without_a_watchdog_says_so_in_one_line_and_starts():
    for machine, wdt_ms in ((_NoWDT, 4000), (simmachine, 10 ** 6)):
        # No WDT in machine; a WDT that refuses the time asked for (a Pico W's longest
        # is 8.3 s). Either way the board starts, without one.
        lines = _board({"ssid": SSID, "password": "s3cret"}, _start,
                       {"wifi": WIFI, "wdt_ms": wdt_ms}, machine)
        assert len(lines) == 2 and lines[0][0].startswith("no watchdog ("), lines
        assert lines[0][0].endswith("wdt_ms %d is not kept" % wdt_ms), lines
        assert lines[1][0].startswith("wifi: joined"), lines
        assert not simmachine.wdts


def test_a_watchdog_alone_needs_no_network():
    lines = _board({"ap": False}, _start, {"wdt_ms": 4000})
    assert [line for line, _ in lines] == ["watchdog: 4000 ms"]
    assert simnet.stats["joins"] == 0


def test_settings_that_cannot_work_are_refused_by_name():
    from edge_runtime import wifi

    for settings, named in (
        ({"wifi": "wren-lab"}, "wifi must be"),
        ({"wifi": {"password": "s3cret"}}, "wifi must be"),
        ({"wifi": {"ssid": ""}}, "wifi must be"),
        ({"wifi": dict(WIFI, try_ms=0)}, "try_ms"),
        ({"wifi": dict(WIFI, backoff_ms=[50, 10])}, "backoff_ms"),
        ({"wifi": dict(WIFI, backoff_ms=[50])}, "backoff_ms"),
        ({"wdt_ms": True}, "wdt_ms"),
        ({"wdt_ms": -5}, "wdt_ms"),
        ({"wdt_ms": "8000"}, "wdt_ms"),
    ):
        e = raises(ValueError, run, wifi.start(settings))
        assert named in str(e), (settings, e)


def test_a_port_without_a_network_module_uses_the_hosts_network():
    before = sys.modules.pop("network", None)
    try:
        try:
            import network  # noqa: F401
            real = True  # a board with Wi-Fi: nothing of this to check here
        except ImportError:
            real = False
        if not real:
            from edge_runtime import wifi
            wifi._on[:] = []  # what an earlier test's board joined
            said = []
            log = platform.log
            platform.log = lambda *parts: said.append(" ".join(parts))
            try:
                run(wifi.start({"wifi": WIFI}))
                run(wifi.connect())  # and the link dials at once
            finally:
                platform.log = log
            assert said == ["no network module on this port; using the host's network"], said
    finally:
        if before is not None:
            sys.modules["network"] = before
