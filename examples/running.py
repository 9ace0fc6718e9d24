"""What a run of an example shares: the timer of its timed loop (checks paused out) and a
progress bar for phases long enough to need one."""
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


def progress(done: int, total: int, width: int = 30) -> None:
    """A bar on stderr, drawn only when both stdout and stderr are terminals (never into a log
    file or a pipe)."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        return
    filled = width * done // total
    if filled == width * (done - 1) // total and done < total:
        return  # redraw only when the bar grows: a log file gets at most `width` frames
    sys.stderr.write(f"\rdecode [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
