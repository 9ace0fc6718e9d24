"""The length rules of the write contract (REQUIREMENTS §2, REQ-2, SAFE-1, SAFE-2; docs/HOST_PATH.md),
written once for Python ints, numpy arrays and torch tensors.

Every function takes the ``max``/``min`` (and ``where``) of its number kind (``max``/``min`` for ints,
``np.maximum``/``np.minimum`` for arrays, ``torch.maximum``/``torch.minimum`` for tensors), so
``KVCache.resize``, ``Batch.resize_rows`` and the flush watermark on host and device apply the
same rule (``Batch.advance``'s refusal rule is the ``advance`` op's, ``advance_row`` in
``csrc/rules.h``). A *shape* is a selection group's ``(tokens_per_unit, max_inflight_tokens)``:
groups of one shape have the same in-flight range.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config imports this module (SparseSpec.inflight_start)
    from .config import CacheConfig


def shapes_of(config: "CacheConfig") -> tuple:
    """The distinct in-flight shapes (U, I) of the config's selection groups."""
    return tuple(sorted({(g.sparse.tokens_per_unit, g.sparse.max_inflight_tokens)
                         for g in config.selection_groups}))


def inflight_start(h, c, shape, mx):
    """s0 = max(h, floor((c - I) / U) * U): [h, s0) is written straight to host pages, [s0, c)
    into cells."""
    U, I = shape
    return mx(h, (c - I) // U * U)


def host_direct_end(h, c, shapes, mx):
    """The largest in-flight start over the shapes (h without sparse layers): every host-direct
    token of every selection group lies below it."""
    end = h
    for shape in shapes:
        end = mx(end, inflight_start(h, c, shape, mx))
    return end


def inflight_width(h, c, shapes, mx):
    """The widest in-flight range over the shapes (0 without sparse layers)."""
    width = c - c
    for shape in shapes:
        width = mx(width, c - inflight_start(h, c, shape, mx))
    return width


def pick(condition, a, b):
    """``where`` for Python numbers."""
    return a if condition else b


def flushed_watermark(h, c, written, declared, target, shapes, mx, mn, where):
    """The written watermark after a flush to ``target`` of the lengths (h, c): tokens up to
    min(target, c) are on host pages when everything below the in-flight range was already
    there or declared written (the flush writes back the in-flight range only). ``where`` is
    ``pick``, ``np.where`` or ``torch.where``."""
    end = host_direct_end(h, c, shapes, mx)
    covered = mx(written, declared) >= end
    reach = mn(target, c)
    extended = mx(written, reach)
    return where(covered, extended, written)


def transition_faults(h, c, h2, c2, written, declared, cells, shapes, mx, mn):
    """The write-contract faults of a resize from (h, c) to (h2, c2), per shape: a list of
    ``(shape, lost, stale)``, each a list of [lo, hi) token ranges; a fault exists where lo < hi.
    ``cells`` = (h, c, end): the published lengths, whose in-flight range [s0(h, c), c) the
    row's cells may hold, and where that range is cut (``end`` <= c: the lowest capacity since
    that publish; a shrink drops the tokens beyond it). (0, 0, 0) for a cache without a
    published lease.

    * lost: tokens that may be in cells and are not on host pages (at or past ``written``)
      would become host-direct: the in-flight start moves past them, so the next resolve drops
      them.
    * stale: tokens on host pages (flushed, or declared written) that the cells do not hold
      would enter the in-flight range: they would be read from the cells and flushed back over
      the good host copy.
    """
    faults = []
    for shape in shapes:
        s0 = inflight_start(h, c, shape, mx)
        s02 = inflight_start(h2, c2, shape, mx)
        p0, p1 = inflight_start(cells[0], cells[1], shape, mx), cells[2]
        lost = [(mx(p0, written), mn(mn(s02, p1), c2))]
        on_host = mx(written, mn(declared, s0))
        lo, hi = mx(h2, s02), mn(on_host, c2)
        stale = [(lo, mn(hi, p0)), (mx(lo, p1), hi)]
        faults.append((shape, lost, stale))
    return faults


def written_prefix(h, c, flushed, declared, shapes, mx, mn):
    """How far history may advance (SAFE-2): through what was flushed, and through the declared
    host writes below every shape's in-flight start; through capacity without sparse layers."""
    if not shapes:
        return c
    start = inflight_start(h, c, shapes[0], mx)
    for shape in shapes[1:]:
        start = mn(start, inflight_start(h, c, shape, mx))
    return mx(flushed, mn(declared, start))


def resize_violations(h, c, h2, c2, flushed, declared, cells, shapes, limit, max_inflight, mx, mn):
    """Every rule of a resize from (h, c) to (h2, c2), in the order ``KVCache.resize`` reports
    them: a list of ``(rule, violated, details)``; ``violated`` is a bool (ints) or a bool array
    (arrays, one entry per row). ``details`` are what the messages print."""
    safe = mn(written_prefix(h, c, flushed, declared, shapes, mx, mn), c2)
    width = inflight_width(h2, c2, shapes, mx)
    out = [("decrease", h2 < h, {}), ("above", h2 > c2, {}), ("limit", c2 > limit, {}),
           ("safe", (h2 > h) & (h2 > safe), {"safe": safe}),
           ("width", width > max_inflight, {"width": width})]
    for shape, lost, stale in transition_faults(h, c, h2, c2, flushed, declared, cells, shapes,
                                                mx, mn):
        (lo, hi), = lost
        out.append(("lost", lo < hi, {"shape": shape, "range": (lo, hi)}))
        for lo, hi in stale:
            out.append(("stale", lo < hi, {"shape": shape, "range": (lo, hi)}))
    return out


def sink_pages(sinks: int, tokens_per_page: int) -> int:
    """The pages a windowed life cycle keeps at the start forever (TIER-3): ceil(sinks / P)
    (csrc/rules.h's sink_pages)."""
    return -(-sinks // tokens_per_page) if sinks > 0 else 0


def first_live_page(history: int, tokens_per_page: int, window) -> int:
    """The first page of a windowed life cycle's window part at history h: pages p >=
    sink_pages with (p + 1) * P <= h - window are released (REQ-3); 0 without a window
    (``window`` None or 0; csrc/rules.h's first_live_page)."""
    if not window or history <= window:
        return 0
    return (history - window) // tokens_per_page


def windowed_peak_pages(window: int, sinks: int, prefill_chunk: int, tokens_per_page: int) -> int:
    """The most pages a request holds in a windowed life cycle while it is prefilled in chunks of
    at most ``prefill_chunk`` tokens and then decodes: its sink pages, and the pages the tokens
    ``[h - chunk - window, h + chunk)`` can touch at a chunk's resize (the window of the history
    the last publish saw, the chunk since, the chunk being allocated), two more for the pages
    those spans straddle."""
    span = window + 2 * max(prefill_chunk, 1)
    return sink_pages(sinks, tokens_per_page) + -(-span // tokens_per_page) + 2


def live_pages(history: int, allocated: int, tokens_per_page: int, window, sinks: int) -> tuple:
    """The page ordinals a cache holds in a life cycle of ``window`` and ``sinks`` at history h
    with ``allocated`` pages: ``(sink_end, first, allocated)``, the pages ``[0, sink_end)`` and
    ``[first, allocated)``; ``sink_end = min(sink_pages, first)``, so the two ranges never
    overlap and pages ``[sink_end, first)`` are released."""
    first = min(first_live_page(history, tokens_per_page, window), allocated)
    return min(sink_pages(sinks, tokens_per_page), first), first, allocated
