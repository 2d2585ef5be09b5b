"""Draw m6 timelines (the Chrome trace JSON that ``trace_file=`` writes) one above the other, as a PNG.

Run from the repository root:

    python examples/m6_inference.py --compare --trace trace.json     # trace-overlap.json, trace-sync.json
    python examples/plot_trace.py trace-sync.json trace-overlap.json --out timeline.png
    python examples/plot_trace.py trace-overlap.json --steps 40,48   # another window of steps

Each file becomes a panel with three tracks: ``schedule`` and ``process`` (the host) and
``forward`` (the worker). Every box is one event, labelled with its step number, so the
eye can follow step N from its schedule to its forward to its process. The panels share
one time axis that starts at the window's first event, and the title of each gives its
hidden host share over the whole trace (the share of schedule + process time that lies
inside a forward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _common  # noqa: F401  (makes `milestones` importable from a plain checkout)
from _common import HelpFormatter

from milestones.trace import TRACKS, hidden_host_share

COLOURS = {"schedule": "#4C72B0", "forward": "#DD8452", "process": "#55A868"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("traces", type=Path, nargs="+", help="trace JSON files, one panel each, top to bottom")
    parser.add_argument("--steps", default="10,17", metavar="FIRST,LAST",
                        help="the steps to draw, inclusive (a window of the run: a whole run is too long to read)")
    parser.add_argument("--out", type=Path, default=Path("timeline.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        first, last = (int(x) for x in args.steps.split(","))
    except ValueError:
        parser.error(f"--steps must be two step numbers like 10,17, got {args.steps!r}")
    if not 1 <= first <= last:
        parser.error(f"--steps {args.steps}: the first step must be at least 1 and not after the last")
    args.steps = (first, last)
    for path in args.traces:
        if not path.is_file():
            parser.error(f"no trace file at {path}: write one with examples/m6_inference.py --trace {path}")
    return args


def load_events(path: Path) -> list[dict]:
    """The complete events of a trace file; a clear error if it is not one that m6 wrote."""
    try:
        events = json.loads(path.read_text())["traceEvents"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        sys.exit(f"{path} is not a Chrome trace written by m6 (trace_file=...): {error}")
    return [e for e in events if e.get("ph") == "X" and e.get("name") in TRACKS]


def draw(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, last = args.steps
    panels = []
    for path in args.traces:
        events = load_events(path)
        window = [e for e in events if first <= e["args"]["step"] <= last]
        if not window:
            steps = max((e["args"]["step"] for e in events), default=0)
            sys.exit(f"{path} has no events for steps {first} to {last} (it has {steps} steps): choose other --steps")
        panels.append((path, events, window))
    width_ms = max((max(e["ts"] + e["dur"] for e in w) - min(e["ts"] for e in w)) / 1e3 for _, _, w in panels)
    figure, axes = plt.subplots(len(panels), 1, figsize=(12, 1.9 * len(panels) + 0.6), squeeze=False)
    for axis, (path, events, window) in zip(axes[:, 0], panels):
        origin = min(e["ts"] for e in window)
        for event in window:
            row = len(TRACKS) - TRACKS[event["name"]]  # schedule on top, process at the bottom
            start, length = (event["ts"] - origin) / 1e3, event["dur"] / 1e3
            axis.broken_barh([(start, length)], (row - 0.4, 0.8), color=COLOURS[event["name"]], edgecolor="white")
            if length > width_ms / 60:  # label the boxes wide enough to hold a number
                axis.text(start + length / 2, row, str(event["args"]["step"]), ha="center", va="center",
                          fontsize=7, color="white")
        axis.set_yticks(range(len(TRACKS)), list(reversed(TRACKS)))
        axis.set_xlim(0, width_ms * 1.01)
        share = hidden_host_share(events)
        axis.set_title(f"{path.name}: steps {first}-{last}; hidden host share {100 * share:.0f}% (whole run)",
                       fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("milliseconds from the window's first event")
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    draw(parse_args())
