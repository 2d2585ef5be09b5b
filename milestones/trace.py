"""A timeline of the engine loop, as Chrome trace JSON (Perfetto and chrome://tracing open it).

Every step leaves three complete events ("ph": "X"): ``schedule`` and ``process`` on the
host, ``forward`` on the device side, each kind on its own track, with the step number
and batch size in ``args``. Side by side, the traces of m6 with and without async
scheduling show what overlap buys: host work moved inside the forwards. Given the
admission's ``refusals``, each ``schedule`` event is followed by a counter event ("ph": "C")
named ``refused``: the steps so far that left a request waiting, by reason, which Perfetto
draws as a graph under the tracks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

TRACKS = {"schedule": 1, "forward": 2, "process": 3}  # one track (tid) per kind of work


class Tracer:
    def __init__(self, enabled: bool, refusals: Mapping[str, int] | None = None) -> None:
        self.enabled = enabled
        self.refusals = refusals  # read, never written: the admission counts, the trace samples
        self.origin = time.perf_counter()
        self.events: list[dict] = []  # appended by the host and by the forward worker (list.append is atomic)

    def now(self) -> float:
        return time.perf_counter()

    def record(self, name: str, start: float, step: int, batch_size: int) -> None:
        """One complete event from ``start`` until now."""
        if self.enabled:
            end = time.perf_counter()
            self.events.append({
                "name": name, "ph": "X", "pid": 1, "tid": TRACKS[name],
                "ts": (start - self.origin) * 1e6, "dur": (end - start) * 1e6,  # microseconds
                "args": {"step": step, "batch_size": batch_size},
            })
            if name == "schedule" and self.refusals is not None:  # what this schedule refused, in the running count
                self.events.append({"name": "refused", "ph": "C", "pid": 1, "ts": (end - self.origin) * 1e6,
                                    "args": dict(self.refusals)})

    def write(self, path: str | Path) -> None:
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
                 for name, tid in TRACKS.items()]
        Path(path).write_text(json.dumps({"traceEvents": names + self.events, "displayTimeUnit": "ms"}))


# --8<-- [start:hidden_share]
def hidden_host_share(events: list[dict]) -> float:
    """The share of host time (schedule + process) that lies inside some forward: the work overlap hides."""
    forwards = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "forward")
    host = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") in ("schedule", "process")]
    total = sum(end - start for start, end in host)
    hidden = sum(max(0.0, min(end, f_end) - max(start, f_start))
                 for start, end in host for f_start, f_end in forwards if f_start < end and start < f_end)
    return hidden / total if total else 0.0
# --8<-- [end:hidden_share]
