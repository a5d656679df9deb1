# Joining Wi-Fi at boot, for a board whose settings name a network (`wifi`: ssid and
# password). Its own module, loaded only then: the unix port and CPython are already on
# a network, and on a small heap every module loaded costs its code and its names.
import time

from edge_runtime.platform import IS_MICROPYTHON, log, ticks_diff, ticks_ms


def connect(settings, timeout_ms=20000):
    # A missing `network` module (a port without Wi-Fi) is logged and skipped.
    wifi = settings.get("wifi")
    if not wifi:
        return True
    try:
        import network
    except ImportError:
        log("no network module on this port; using the host network")
        return True
    sta = network.WLAN(network.STA_IF)
    sta.active(True)
    if not sta.isconnected():
        sta.connect(wifi.get("ssid"), wifi.get("password"))
        start = ticks_ms()
        while not sta.isconnected() and ticks_diff(ticks_ms(), start) < timeout_ms:
            time.sleep_ms(100) if IS_MICROPYTHON else time.sleep(0.1)
    log("wifi", "connected" if sta.isconnected() else "not connected")
    return sta.isconnected()
