"""Container start times from containerd's log: its CRI service logs ``StartContainer for "<id>"`` when the call
arrives and ``StartContainer for "<id>" returns successfully`` when it returns. In between, runc creates the
container (its createContainer hooks run there: the CDI hooks) and starts it."""
from __future__ import annotations

import re
from datetime import datetime

_LINE = re.compile(r'^time="(?P<time>[^"]+)" level=\w+ msg="StartContainer for \\"(?P<id>[0-9a-f]+)\\"(?P<done> returns '
                   r'successfully)?"')


def _seconds(stamp: str) -> float:
    """RFC 3339 with nanoseconds (containerd's logrus format) as epoch seconds, to the microsecond."""
    head, _, rest = stamp.partition(".")
    frac = "".join(ch for ch in rest if ch.isdigit())
    zone = rest[len(frac):] or "Z"
    moment = datetime.fromisoformat(f"{head}{'+00:00' if zone == 'Z' else zone}")
    return moment.timestamp() + float(f"0.{frac or '0'}")


def start_container_seconds(text: str) -> dict[str, float]:
    """Container id -> seconds its StartContainer call took, for every call in ``text`` that returned successfully
    (a failed or unfinished one is left out; a container started twice keeps the last)."""
    started: dict[str, float] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        at = _seconds(m["time"])
        if m["done"]:
            if m["id"] in started:
                out[m["id"]] = at - started.pop(m["id"])
        else:
            started[m["id"]] = at
    return out
