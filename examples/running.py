"""What a run of an example shares: the timer of its timed loop (checks paused out), the
progress of phases long enough to need it, and a warning with an estimate of how long a phase
will take when that is more than a few minutes (both on stderr)."""
import sys
import time
from contextlib import contextmanager

import torch


class Timer:
    """Wall time of the decode loop with the checks paused out (synchronising the GPU at each
    edge, unless a pause only queues GPU work)."""

    def __init__(self, device):
        self.device, self.elapsed, self.started = device, 0.0, None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start(self, sync: bool = True):
        if sync:
            self._sync()
        self.started = time.perf_counter()

    def stop(self, sync: bool = True):
        if self.started is not None:
            if sync:
                self._sync()
            self.elapsed += time.perf_counter() - self.started
            self.started = None

    @contextmanager
    def paused(self, sync: bool = True):
        """Not timed: what runs inside. ``sync`` False leaves the GPU running (for work that is
        only queued inside, and whose GPU time is negligible)."""
        running = self.started is not None
        self.stop(sync)
        try:
            yield
        finally:
            if running:
                self.start(sync)


LONG_S = 180.0  # "more than a few minutes": a phase projected to last longer is announced
_announced = []  # an estimate said so already: one line per run, not one per phase


def duration(seconds: float) -> str:
    """A duration in words: 40 s, 12 min, 3.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Estimate:
    """One line on stderr, at most once, when the rest of ``total`` units of work looks set to
    take more than ``long`` seconds. The rate is measured from the first ``update`` on (what
    came before it, a setup or a first unit that compiles or warms up, is not the rate), and,
    once ``probe`` seconds have passed since, each ``update`` projects it over the units left.
    The line says how long, at what rate, and which ``flags`` set the amount of work (lower them
    for a shorter run). Work that is done before that, or whose rest projects shorter, says
    nothing; so does every estimate after the first that spoke in this process (one such line
    per run)."""

    def __init__(self, what: str, total: int, unit: str = "steps", flags: tuple = (),
                 probe: float = 2.0, long: float = LONG_S):
        self.what, self.total, self.unit, self.flags = what, total, unit, tuple(flags)
        self.probe, self.long = probe, long
        self.first = None  # (time, done) of the first update: the rate is measured from there
        self.said = False

    def update(self, done: int, newline: bool = False) -> None:
        """``done`` of ``total`` finished; ``newline``: end a line drawn in place (a bar) first."""
        if self.said or _announced or done <= 0 or done >= self.total:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = (now, done)
            return
        elapsed, measured = now - self.first[0], done - self.first[1]
        if elapsed < self.probe or measured <= 0:
            return
        each = elapsed / measured
        left = each * (self.total - done)
        if left <= self.long:
            return
        self.said = True
        _announced.append(self.what)
        lower = f"; lower {' or '.join(self.flags)} for a shorter run" if self.flags else ""
        rate = duration(each) if each >= 1 else f"{each * 1e3:.3g} ms"
        start = "\n" if newline else ""
        sys.stderr.write(f"{start}{self.what}: {self.total:,} {self.unit} will "
                         f"take about {duration(left)} more at the rate so far ({rate} each; "
                         f"{done:,} done){lower}\n")
        sys.stderr.flush()


class Progress:
    """Progress of one phase of a run on stderr, never on stdout. On a terminal (stdout and
    stderr both) a bar, redrawn only when it grows; otherwise, so that a log file or a pipe
    shows a long phase is alive, one line every ``every`` seconds once the phase has run that
    long (a phase shorter than that prints nothing). Either way, a phase projected to last more
    than a few minutes says so once, with its estimate and the ``flags`` that set its length
    (``Estimate``)."""

    def __init__(self, what: str, total: int, unit: str = "steps", every: float = 5.0,
                 width: int = 30, flags: tuple = ()):
        self.what, self.total, self.unit, self.every, self.width = what, total, unit, every, width
        self.terminal = sys.stdout.isatty() and sys.stderr.isatty()
        self.started = self.last = time.monotonic()
        self.estimate = Estimate(what, total, unit, flags)

    def update(self, done: int) -> None:
        """``done`` of ``total`` finished."""
        self.estimate.update(done, newline=self.terminal)
        if self.terminal:
            self._bar(done)
            return
        now = time.monotonic()
        if now - self.last >= self.every and done < self.total:
            self.last = now
            sys.stderr.write(f"{self.what}: {done}/{self.total} {self.unit} after "
                             f"{now - self.started:.0f} s\n")
            sys.stderr.flush()

    def _bar(self, done: int) -> None:
        total, width = self.total, self.width
        filled = width * done // total
        if filled == width * (done - 1) // total and done < total:
            return  # redraw only when the bar grows: at most `width` frames
        sys.stderr.write(f"\r{self.what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def announce(message: str) -> None:
    """One line on stderr before a phase that may take a while and reports no progress of its
    own (a compilation)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
