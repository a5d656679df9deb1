# A simulated `machine` module with the one part the board tests need: a watchdog
# (machine.WDT) that counts its feeds. The unix port's own machine has no WDT and
# CPython has no machine at all. Tests only, like network.py here: a test puts it in
# sys.modules["machine"], or this folder ahead on a virtual board's MICROPYPATH. A
# virtual board's feeds reach the test through the JSON file named in WREN_SIM_WDT
# ({"timeout": ms, "feeds": n}), written again at each feed.
import json
import os

# Every watchdog made, in order, for the test to read.
wdts = []
# rp2's longest watchdog, 2^23 us; an ESP32 takes longer ones. A board asking for more
# gets the port's ValueError, as on a Pico W.
MAX_MS = 8388


class WDT:
    def __init__(self, id=0, timeout=5000):
        if not 1 <= timeout <= MAX_MS:
            raise ValueError("timeout out of range")
        self.timeout = timeout
        self.feeds = 0
        self._file = os.getenv("WREN_SIM_WDT") if hasattr(os, "getenv") else None
        wdts.append(self)

    def feed(self):
        self.feeds += 1
        if self._file:
            with open(self._file + ".tmp", "w") as f:
                json.dump({"timeout": self.timeout, "feeds": self.feeds}, f)
            os.rename(self._file + ".tmp", self._file)
