"""The thread count of the one-call decode step, chosen by measured wall time.

Why: a decode step runs ~150 OpenMP regions (4 GEMMs and the attention per layer), each ending
in a barrier. On an idle 2-core machine two threads make a 32-request step ~1.7x faster than
one; when another process keeps a core busy, the second thread is descheduled for a time slice
at a time and every barrier waits for it, so two threads run 2-3x slower than one. Which count is
faster depends on the machine's load at the moment, which no setting given at start-up knows.

:class:`ThreadChooser` runs the step on the current count and, every ``probe_every`` steps (and
once early, at the 8th step), one step on the other count (1 or all of torch's threads); when
that step's wall time beats the recent steps of the same batch size by a margin, the next step is
a second probe on the same count, and only if it wins too does the chooser switch. The second
probe is there because this machine's speed swings by up to 1.5x within a second with no other
process running (benchmarks/README.md, cpuvar): one lucky step on one thread against steps slowed
by such a swing could win alone, and a false switch to one thread costs half the speed until the
next probe, ``probe_every`` steps later. Probing costs one step in ``probe_every`` on the slower
count (~1% on an idle machine). Results do not depend on the thread
count (every output element is computed by one thread in one fixed order), so switching never
changes tokens. ``DEEPINFER_ADAPTIVE_THREADS=0`` keeps torch's thread count.
"""

from __future__ import annotations

from .. import envs

ENV_SWITCH = "DEEPINFER_ADAPTIVE_THREADS"


def adaptive_enabled() -> bool:
    """Read when a decode plan is built. Only ``1`` (the default) and ``0`` are accepted, so that
    a value such as ``false`` or ``off`` is refused instead of silently leaving the switch on."""
    return envs.get(ENV_SWITCH)


class ThreadChooser:
    """Per decode plan: :meth:`pick` before a step, :meth:`record` after it."""

    def __init__(
        self, probe_every: int = 64, margin: float = 0.85, smoothing: float = 0.3, first_probe: int = 8
    ) -> None:
        self.probe_every, self.margin, self.smoothing = probe_every, margin, smoothing
        self.first_probe = first_probe  # one early probe, so that a short generation on a loaded machine gains too
        self.current: int | None = None  # None: torch's count, until a probe wins
        self.switches = 0
        self._steps = 0
        self._probing: int | None = None
        self._won: int | None = None  # the count whose first probe won: the next step probes it again
        self._confirming = False  # this step is that second probe
        self._recent: tuple[int, int, float] | None = None  # (threads, rows, smoothed wall ms)

    def pick(self, max_threads: int, rows: int) -> int:
        current = max_threads if self.current is None or self.current > max_threads else self.current
        self.current = current
        self._steps += 1
        self._probing = None
        self._confirming, self._won = self._won is not None, None
        due = self._confirming or self._steps % self.probe_every == 0 or self._steps == self.first_probe
        if max_threads > 1 and due and self._comparable(current, rows):
            self._probing = 1 if current > 1 else max_threads
            return self._probing
        return current

    def record(self, threads: int, rows: int, wall_ms: float) -> None:
        if self._probing is not None and threads == self._probing:
            if self._comparable(self.current, rows) and wall_ms < self.margin * self._recent[2]:
                if self._confirming:  # the second win in a row: switch
                    self.current, self.switches, self._recent = threads, self.switches + 1, (threads, rows, wall_ms)
                else:
                    self._won = threads
            return
        if self._comparable(threads, rows):
            ewma = self._recent[2]
            self._recent = (threads, rows, ewma + self.smoothing * (wall_ms - ewma))
        else:  # another batch size or count: start over
            self._recent = (threads, rows, wall_ms)

    def _comparable(self, threads: int | None, rows: int) -> bool:
        return self._recent is not None and self._recent[:2] == (threads, rows)
