"""What a run of an example shares: the timer of its timed loop (checks paused out) and the
progress of phases long enough to need it (on stderr)."""
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


class Progress:
    """Progress of one phase of a run on stderr, never on stdout. On a terminal (stdout and
    stderr both) a bar, redrawn only when it grows; otherwise, so that a log file or a pipe
    shows a long phase is alive, one line every ``every`` seconds once the phase has run that
    long (a phase shorter than that prints nothing)."""

    def __init__(self, what: str, total: int, unit: str = "steps", every: float = 5.0,
                 width: int = 30):
        self.what, self.total, self.unit, self.every, self.width = what, total, unit, every, width
        self.terminal = sys.stdout.isatty() and sys.stderr.isatty()
        self.started = self.last = time.monotonic()

    def update(self, done: int) -> None:
        """``done`` of ``total`` finished."""
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
