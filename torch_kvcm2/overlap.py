"""Fetches on a second stream, overlapped with attention (REQUIREMENTS §8 ordering; docs/ENGINE.md,
"Fetch overlapped with attention"; docs/DESIGN.md, "Streams and ordering").

A selection group's fetch copies its misses from host pages into cells: PCIe-bound work that
needs nothing of the step but the group's resolve. ``FetchStream`` runs it on a side stream so
the current stream goes on with work that does not touch those cells (the previous group's
attention, the layer's projections) while the misses are in flight::

    fetches = FetchStream(batch)
    # per step, after publish; per selection group g, in layer order:
    batch.resolve(g, selected_g)          # current stream: residency, miss list, write indices
    fetches.fetch(*layers_of_g)           # side stream: after the resolve, the cells of g
    ...                                   # other work on the current stream
    fetches.wait(layer)                   # per layer, before its new token's write and attention
    # after the last layer's attention:
    fetches.join()                        # the current stream after every fetch of the step
    batch.flush(...)

Ordering, by events only (no host wait), eagerly and inside one captured CUDA graph (stream
capture records the event waits as graph edges; the side stream joins the capture at its first
``fetch`` and leaves it at ``join``):

* ``fetch`` first makes the side stream wait for everything queued on the current stream: the
  group's resolve, which wrote the miss list the fetch reads, and the previous step's attention
  and flush of the group, which read the cells the fetch overwrites;
* ``wait(layer)`` makes the current stream wait for the layer's latest fetch, so the new
  token's write (a partly written head unit is fetched whole) and attention read the cells
  only after the fetch;
* ``join`` makes the current stream wait for all of the side stream's work, so the group's
  next resolve never rewrites a miss list a fetch still reads. It is required before a
  capture ends (a forked stream must rejoin) and at the end of each eager step.

On a CPU device ``fetch`` runs the fetch at once and ``wait`` and ``join`` do nothing: the same
calls give the same results on either device.
"""
from __future__ import annotations

from typing import Optional

import torch


class FetchStream:
    """Fetches of a batch on a side stream, ordered against the current stream by events.

    ``FetchStream(batch, stream=None)``: ``stream`` a ``torch.cuda.Stream`` of the batch's
    device (default: a new one); a CPU batch takes none. Fetch, wait and join as the module
    docstring says. Not for ``torch.compile`` (streams are not traced); eager and stream
    capture only.
    """

    def __init__(self, batch, stream: Optional["torch.cuda.Stream"] = None):
        self.batch = batch
        self.device = batch.config.device
        self.cuda = self.device.type == "cuda"
        if not self.cuda:
            if stream is not None:
                raise ValueError("FetchStream: a CPU batch runs its fetches inline; pass no stream")
            self.stream = None
            return
        if stream is None:
            stream = torch.cuda.Stream(device=self.device)
        elif not isinstance(stream, torch.cuda.Stream) or stream.device != torch.device(
                "cuda", self.device.index if self.device.index is not None
                else torch.cuda.current_device()):
            raise ValueError(f"FetchStream: stream must be a torch.cuda.Stream on the batch's "
                             f"device {self.device}, got {stream!r}")
        self.stream = stream
        self._ready = torch.cuda.Event()  # the current stream's work before a fork
        self._joined = torch.cuda.Event()  # the side stream's work before a join
        self._done: dict[tuple, torch.cuda.Event] = {}  # per tuple of layers fetched together
        self._pending: dict[str, torch.cuda.Event] = {}  # layer -> its fetch, not waited for
        self._forked = False  # the side stream has work the current stream has not joined

    @property
    def pending(self) -> list[str]:
        """Layers fetched on the side stream whose fetch the current stream has not waited for
        (``wait`` or ``join``); always empty on a CPU device."""
        return list(self._pending) if self.cuda else []

    def fetch(self, *layers: str) -> None:
        """``Batch.fetch(*layers)`` (layers of one selection group, after its resolve) on the
        side stream, after the current stream's work queued so far. Raises what
        ``Batch.fetch`` raises (unknown layers, layers of two groups, an unpublished batch)."""
        if not self.cuda:
            self.batch.fetch(*layers)
            return
        current = torch.cuda.current_stream(self.device)
        self._ready.record(current)
        self.stream.wait_event(self._ready)
        done = self._done.get(layers)
        if done is None:
            done = self._done[layers] = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.batch.fetch(*layers)
            done.record(self.stream)
        self._forked = True
        for layer in layers:
            self._pending[layer] = done

    def wait(self, *layers: str) -> None:
        """Make the current stream wait for the latest fetch of each of ``layers`` (once; a
        layer with no fetch pending, or fetched on the current stream, needs none)."""
        if not self.cuda:
            return
        current = torch.cuda.current_stream(self.device)
        waited = set()
        for layer in layers:
            event = self._pending.pop(layer, None)
            if event is not None and id(event) not in waited:
                current.wait_event(event)
                waited.add(id(event))

    def join(self) -> None:
        """Make the current stream wait for all work on the side stream (every fetch so far):
        before the groups' next resolves, and before a capture ends."""
        if not self.cuda or not self._forked:
            return
        self._joined.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(self._joined)
        self._pending.clear()
        self._forked = False
