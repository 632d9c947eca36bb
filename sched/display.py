"""What a person watching `asyncrl run` sees: a live table when stdout is a terminal and
`logging.progress` is on, otherwise one plain line every PLAIN_EVERY_S seconds (logs, CI, pipes)."""

from __future__ import annotations

import sys
import time

PLAIN_EVERY_S = 10.0
LIVE_EVERY_S = 0.25
"""The loop reports every round; redrawing the table that often would cost the driver CPU it needs."""


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def status_line(s: dict) -> str:
    return (
        f"step {s['step']}/{s['steps']}  {s['elapsed_s']:6.0f}s  reward {_fmt(s['reward'])}  "
        f"held-out {_fmt(s['accuracy'], '.1%')}  staleness {_fmt(s['staleness'], '.2f')}  "
        f"{_fmt(s['rollouts_per_s'], '.1f')} rollouts/s  in flight {s['in_flight']}"
    )


class Display:
    def __init__(self, progress: bool) -> None:
        self.live = None
        self._last = 0.0
        if progress and sys.stdout.isatty():
            from rich.live import Live

            self.live = Live(auto_refresh=False)
            self.live.start()

    def update(self, status: dict) -> None:
        if time.monotonic() - self._last < (LIVE_EVERY_S if self.live is not None else PLAIN_EVERY_S):
            return
        self._last = time.monotonic()
        if self.live is not None:
            self.live.update(self._table(status), refresh=True)
        else:
            print(status_line(status), flush=True)

    def say(self, line: str) -> None:
        """A line that stays (evaluations, checkpoints), above the live table."""
        if self.live is not None:
            self.live.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()

    @staticmethod
    def _table(s: dict):
        from rich.table import Table

        table = Table(title=f"asyncrl run ({s['mode']})", show_header=False, min_width=60)
        before = f"  (before RL {_fmt(s['accuracy_before'], '.1%')})"
        rows = [
            ("step", f"{s['step']} / {s['steps']}   {s['elapsed_s']:.0f} s"),
            ("reward (last step)", _fmt(s["reward"])),
            ("held-out accuracy", _fmt(s["accuracy"], ".1%") + before),
            ("staleness (mean lag)", _fmt(s["staleness"], ".2f")),
            ("throughput", f"{_fmt(s['rollouts_per_s'], '.1f')} rollouts/s, {_fmt(s['samples_per_s'], '.1f')} trained/s"),
            ("episodes", f"{s['in_flight']} in flight, {s['ahead']} ahead of the learner"),
            ("ledger", "  ".join(f"{k} {v}" for k, v in s["ledger"].items())),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table
