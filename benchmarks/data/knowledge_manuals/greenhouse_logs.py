"""Writes docs/log_gh-north_<date>.txt: a week of one greenhouse board's log.

    python greenhouse_logs.py

Made up for this benchmark and deterministic (a fixed seed, no clock): the same
seven files on every run. A reading every 15 minutes (air temperature and
humidity, soil moisture of three beds, light, supply voltage), the vent and the
watering as the readings drive them, the events of the week written below (a
frost night, a stalled fan, a watchdog reset, a firmware update, a low tank, a
heat alarm, a power cut, ...) and a summary line at the end of each day. The
questions about them are in questions.jsonl, as for the manual pages.
"""

from __future__ import annotations

import math
import random
from datetime import date, timedelta
from pathlib import Path

FIRST = date(2026, 5, 11)
DAYS = 7
SEED = 20260511
BOARD = "gh-north"

#: Per day: mean and swing of the air temperature (coldest at 03:00, warmest at
#: 15:00), mean humidity, and the day's light at noon (cloud cover).
WEATHER = [
    (13.0, 7.0, 72, 38000),
    (9.5, 8.0, 78, 21000),
    (16.0, 8.5, 70, 41000),
    (12.5, 5.0, 83, 12000),
    (23.0, 13.0, 60, 52000),
    (17.0, 6.0, 74, 30000),
    (15.0, 4.0, 88, 9000),
]

#: (day, "HH:MM:SS", level, source, message). {air} and {rh} are the readings'
#: values at that time, so an event and the lines around it agree.
EVENTS = [
    (
        0,
        "00:00:03",
        "INFO",
        "boot",
        "wren 0.9.3 on esp32s3, reset cause power-on, free heap 182304 bytes",
    ),
    (0, "00:00:09", "INFO", "wifi", "connected to greenhouse-ap, rssi -67 dBm, ip 192.168.40.23"),
    (0, "00:00:11", "INFO", "mqtt", "connected to bridge.lan:8883 over TLS, clean session"),
    (
        0,
        "08:41:17",
        "INFO",
        "agent",
        "run r-1001 from operator: 'is it warm enough to move the tomato "
        "seedlings out?' answered after 3 tool calls (4.2 s)",
    ),
    (
        0,
        "13:12:40",
        "WARN",
        "sensors",
        "soil probe B: CRC mismatch on read, retry 1 of 3 succeeded",
    ),
    (0, "16:30:02", "INFO", "note", "operator: planted 24 basil seedlings in bed 3"),
    (
        1,
        "01:40:00",
        "WARN",
        "climate",
        "frost guard: air {air}C under threshold 2.5C, heater relay K2 switched on",
    ),
    (
        1,
        "04:52:00",
        "INFO",
        "climate",
        "frost guard: heater relay K2 off after 3h12m, energy 1.15 kWh",
    ),
    (1, "03:10:12", "WARN", "wifi", "disconnected from greenhouse-ap, reason beacon timeout"),
    (1, "03:11:49", "INFO", "wifi", "reconnected after 97 s, rssi -71 dBm"),
    (1, "03:11:52", "INFO", "mqtt", "reconnected; 6 readings held in the outbox were sent"),
    (
        1,
        "14:02:31",
        "ERROR",
        "fans",
        "fan2 stalled: tachometer 0 rpm at 80% duty; continuing on fan1 alone",
    ),
    (
        1,
        "15:34:10",
        "INFO",
        "note",
        "operator: removed a wasp nest from the fan2 housing, fan2 back at 1420 rpm",
    ),
    (1, "15:34:40", "INFO", "fans", "fan2 tachometer 1420 rpm, both fans in service"),
    (
        2,
        "02:47:31",
        "ERROR",
        "watchdog",
        "main loop silent for 8.0 s, last task soil (i2c read on bus 0); resetting",
    ),
    (
        2,
        "02:47:34",
        "INFO",
        "boot",
        "wren 0.9.3 on esp32s3, reset cause watchdog, free heap 181952 bytes",
    ),
    (
        2,
        "02:47:40",
        "INFO",
        "mqtt",
        "connected to bridge.lan:8883 over TLS, session resumed, 0 readings lost",
    ),
    (
        2,
        "09:15:22",
        "INFO",
        "agent",
        "run r-1017 from operator: 'how much water did bed 2 get yesterday?' "
        "answered after 2 tool calls (3.1 s)",
    ),
    (
        2,
        "11:00:05",
        "INFO",
        "ota",
        "firmware 0.9.4 downloaded (412 KB), signature verified, staged for 23:00",
    ),
    (2, "23:00:00", "INFO", "ota", "applying firmware 0.9.4 to slot B, rebooting"),
    (
        2,
        "23:00:41",
        "INFO",
        "boot",
        "wren 0.9.4 on esp32s3, reset cause software, free heap 183616 bytes",
    ),
    (
        2,
        "23:00:52",
        "INFO",
        "ota",
        "0.9.4 passed its self-test and was marked good, slot A kept as fallback",
    ),
    (3, "06:00:00", "WARN", "water", "tank level 18%, under the 20% refill mark"),
    (
        3,
        "07:00:02",
        "WARN",
        "water",
        "tank at 16%: watering cut to 2 minutes per bed to keep a reserve",
    ),
    (3, "10:25:13", "INFO", "note", "operator: tank refilled to 95% from the rain butts"),
    (
        3,
        "12:40:00",
        "WARN",
        "storage",
        "sd card 91% full; rotated logs and deleted readings older than 30 days, 1.2 MB freed",
    ),
    (3, "17:10:00", "WARN", "door", "side door open for 45 minutes with air at {air}C"),
    (3, "17:12:30", "INFO", "door", "side door closed"),
    (
        4,
        "13:55:00",
        "WARN",
        "climate",
        "air {air}C over the 35.0C high limit: shade screen closed, misting for 2 minutes",
    ),
    (
        4,
        "14:20:00",
        "WARN",
        "alert",
        "sent 'heat stress' to greenhouse/north/alert (air {air}C, rh {rh}%)",
    ),
    (4, "16:40:00", "INFO", "climate", "shade screen opened, air back under 30.0C"),
    (
        4,
        "19:20:14",
        "WARN",
        "mqtt",
        "connection refused by bridge.lan three times, retrying with backoff",
    ),
    (4, "19:20:55", "INFO", "mqtt", "connected after 41 s; the broker had restarted"),
    (
        4,
        "21:03:09",
        "ERROR",
        "agent",
        "run r-1044 from operator: 'summarise today's heat alarms' failed, model "
        "timeout after 30 s, no answer delivered",
    ),
    (5, "04:00:00", "INFO", "ntp", "clock stepped by +2.3 s from pool.ntp.org"),
    (
        5,
        "09:30:00",
        "ERROR",
        "sensors",
        "light sensor bh1750 stuck at 65535 lux for 10 minutes, re-initialised",
    ),
    (5, "11:45:07", "WARN", "power", "mains supply lost, running on the backup battery"),
    (5, "12:20:31", "INFO", "power", "mains supply restored after 35 minutes, battery at 3.94 V"),
    (5, "15:02:44", "INFO", "note", "operator: harvested 1.8 kg of tomatoes from bed 1"),
    (
        6,
        "06:30:00",
        "INFO",
        "sensors",
        "soil probe A recalibrated: dry 2910, wet 1330, saved to flash",
    ),
    (
        6,
        "10:00:00",
        "WARN",
        "climate",
        "humidity over 95% for 2 hours, botrytis risk: circulation fans on",
    ),
    (6, "12:05:00", "INFO", "climate", "humidity under 85% again, circulation fans back to normal"),
    (6, "20:00:00", "INFO", "report", "weekly report sent to greenhouse/north/report"),
    (
        6,
        "22:15:18",
        "WARN",
        "mqtt",
        "outbox 180 of 200 messages while the link is slow; oldest readings are "
        "dropped first beyond 200",
    ),
]


def air(day: int, minutes: float, rng: random.Random) -> float:
    mean, swing, _, _ = WEATHER[day]
    return mean - swing * math.cos(2 * math.pi * (minutes / 60 - 3) / 24) + rng.uniform(-0.3, 0.3)


def humidity(day: int, temp: float, rng: random.Random) -> int:
    mean = WEATHER[day][2]
    return max(30, min(99, round(mean - 1.8 * (temp - WEATHER[day][0]) + rng.uniform(-2, 2))))


def light(day: int, minutes: float, rng: random.Random) -> int:
    h = minutes / 60
    if h < 5.5 or h > 21:
        return 0
    return max(
        0, round(WEATHER[day][3] * math.sin(math.pi * (h - 5.5) / 15.5) * rng.uniform(0.85, 1.1))
    )


def stamp(d: date, minutes: float) -> str:
    seconds = round(minutes * 60)
    return f"{d.isoformat()}T{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}Z"


def to_minutes(hms: str) -> float:
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 60 + m + s / 60


def day_log(
    day: int, rng: random.Random, soil: list[float], vent_open: bool
) -> tuple[list[str], bool]:
    d = FIRST + timedelta(days=day)
    lines: list[tuple[float, str]] = []
    temps: list[tuple[float, float]] = []
    water = 0.0
    vent_minutes = 0
    opened_at = 0.0
    tank_low = day == 3
    for step in range(96):
        m = step * 15.0
        t = air(day, m, rng)
        rh = humidity(day, t, rng)
        temps.append((t, m))
        for bed in range(3):
            soil[bed] = max(12.0, soil[bed] - rng.uniform(0.15, 0.35) - max(0.0, t - 20) * 0.04)
        if m in (7 * 60, 18 * 60) and not (day == 1 and m == 7 * 60):
            for bed in range(3):
                minutes_on = 2 if tank_low and m == 7 * 60 else 4 + bed
                litres = round(minutes_on * 0.55, 1)
                water += litres
                soil[bed] = min(48.0, soil[bed] + minutes_on * 2.1)
                lines.append(
                    (
                        m + 0.1 + bed * 0.1,
                        f"{stamp(d, m + 0.1 + bed * 0.1)} INFO  water    "
                        f"bed {bed + 1} watered for {minutes_on} min, {litres} L",
                    )
                )
        if not vent_open and t > 24.0:
            vent_open, opened_at = True, m
            lines.append(
                (m + 0.05, f"{stamp(d, m + 0.05)} INFO  vent     roof vent opened, air {t:.1f}C")
            )
        elif vent_open and t < 22.0:
            vent_open = False
            vent_minutes += round(m - opened_at)
            lines.append(
                (m + 0.05, f"{stamp(d, m + 0.05)} INFO  vent     roof vent closed, air {t:.1f}C")
            )
        volts = 5.02 if not (day == 5 and 11.75 * 60 < m < 12.34 * 60) else 3.98
        lines.append(
            (
                m,
                f"{stamp(d, m)} INFO  sensors  air={t:.1f}C rh={rh}% "
                f"soil={soil[0]:.0f}/{soil[1]:.0f}/{soil[2]:.0f}% "
                f"lux={light(day, m, rng)} supply={volts:.2f}V",
            )
        )
    if vent_open:
        vent_minutes += round(24 * 60 - opened_at)
    if day == 1:
        lines.append(
            (
                7 * 60 + 0.1,
                f"{stamp(d, 7 * 60 + 0.1)} INFO  water    morning watering skipped: "
                f"air under 5C at 07:00",
            )
        )
    for ev_day, hms, level, source, message in EVENTS:
        if ev_day != day:
            continue
        m = to_minutes(hms)
        t = air(day, m, random.Random(f"{day} {hms}"))
        text = message.format(air=f"{t:.1f}", rh=humidity(day, t, random.Random(7)))
        lines.append((m, f"{d.isoformat()}T{hms}Z {level:<5} {source:<8} {text}"))
    low, low_at = min(temps)
    high, high_at = max(temps)
    summary = (
        f"{stamp(d, 23 * 60 + 59.9)} INFO  summary  day {d.isoformat()}: air min {low:.1f}C at "
        f"{stamp(d, low_at)[11:16]}, max {high:.1f}C at {stamp(d, high_at)[11:16]}; "
        f"water {water:.1f} L; roof vent open {vent_minutes // 60}h{vent_minutes % 60:02d}m"
    )
    lines.append((23 * 60 + 59.9, summary))
    lines.sort(key=lambda x: x[0])
    return [text for _, text in lines], vent_open


def main() -> None:
    rng = random.Random(SEED)
    docs = Path(__file__).resolve().parent / "docs"
    soil = [34.0, 31.0, 36.0]
    vent_open = False
    for day in range(DAYS):
        lines, vent_open = day_log(day, rng, soil, vent_open)
        name = f"log_{BOARD}_{(FIRST + timedelta(days=day)).isoformat()}.txt"
        (docs / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
