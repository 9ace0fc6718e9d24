"""Selection locality for the serving benchmark: how a row's top-K changes from step to step,
with defaults fitted to published LRU miss rates, and the misses an LRU set of S slots takes.

Random weights have no locality (each step's top-K would be a fresh draw), so P-SERVE injects
one. Published (HiSparse, arXiv 2608.07009, via its public summaries; docs/DESIGN.md, "The
serving benchmark"): GLM-5.1 at top-k 2048 under LRU misses about 30% of its selection with a
2048-slot hot buffer, 13.4% with 4096 and 6.7% with 8192.

The model (``Reuse``), per row and step: ``turnover`` of the K selected units leave, drawn
uniformly, and as many enter. An entering unit is, with probability ``returning``, one that left
``a`` steps ago (``a >= 1`` geometric with mean ``age`` steps), else (or when that step's leavers are used up)
a unit never selected before (the oldest leaver once the context has none). An LRU set of S slots keeps the selection and roughly the ``S - K`` units
that left most recently, so with S = K every entering unit misses (the miss rate is the
turnover), and larger sets catch the returners of short age. Fitted to the three points by a
grid search over ``fit`` (2026-12-07): turnover 0.30, returning 0.77, mean age 3.6 steps give
30.0%, 13.4% and 6.9% at K = 2048 (``tests/test_serve_benchmark.py`` pins the fit).

``lru_misses`` simulates a plain LRU of S slots per row (every selected unit touched each step,
the decoded token taking a slot as the library's in-flight unit does, the least recently
touched unit evicted): the model's expected misses, printed beside the misses torch_kvcm2's
``metrics()`` counts (its resolve breaks ties between units touched in the same step its own
way, so the two agree closely, not exactly; the benchmark checks 5%).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# published LRU miss rates at top-k 2048: slots -> share of the selection missed
PUBLISHED = {2048: 0.30, 4096: 0.134, 8192: 0.067}


@dataclass(frozen=True)
class Reuse:
    turnover: float = 0.30  # share of the K selected units replaced each step
    returning: float = 0.77  # share of the entering units that were selected before
    age: float = 3.6  # mean steps since a returning unit left

    def selections(self, context: int, K: int, steps: int, rows: int, seed: int,
                   patterns: int = 8) -> tuple[np.ndarray, np.ndarray]:
        """(int32[steps, rows, K] each row's selected positions in [0, context) per step, and
        int64[rows] the pattern each row follows): ``patterns`` rows are drawn from the model,
        the others repeat one of them shifted by a random offset modulo ``context`` (the same
        reuse, other positions; drawing every row would cost seconds at 512 rows)."""
        patterns = min(patterns, rows)
        base = np.stack([self._row(np.random.default_rng([seed, r]), context, K, steps)
                         for r in range(patterns)], axis=1)  # [steps, patterns, K]
        which = np.arange(rows) % patterns
        shift = np.random.default_rng([seed, 1 << 20]).integers(0, context, rows, dtype=np.int32)
        shift[:patterns] = 0
        out = base[:, which]  # int32 throughout: 120 MB at 512 rows, K = 2048 and 29 steps
        out += shift[None, :, None]
        out %= context
        return out, which

    def _row(self, rng, context: int, K: int, steps: int) -> np.ndarray:
        n = max(1, round(self.turnover * K))
        if context < K + n:
            raise ValueError(f"a context of {context} tokens is too short for a top-{K} "
                             f"selection turning over {n} units a step")
        order = rng.permutation(context)
        selected = order[:K].copy()
        fresh = order[K:]  # never selected yet, taken from the front
        left: list[np.ndarray] = []  # left[i]: units that left i+1 steps ago, not returned
        p = 1 - math.exp(-1 / self.age)  # geometric ages of mean ~ self.age
        out = np.empty((steps, K), dtype=np.int32)
        out[0] = selected
        for t in range(1, steps):
            leave = rng.choice(K, size=n, replace=False)
            gone = selected[leave]
            ages = rng.geometric(p, size=n)
            ages = ages[(rng.random(n) < self.returning) & (ages <= len(left))]
            back = []
            for a, c in enumerate(np.bincount(ages - 1, minlength=len(left))):
                if c and len(left[a]):
                    take = rng.permutation(len(left[a]))
                    back.append(left[a][take[:c]])
                    left[a] = left[a][take[c:]]
            back = np.concatenate(back) if back else np.zeros(0, dtype=selected.dtype)
            short = n - len(back)  # the rest: units never selected, else the oldest leavers
            new, fresh = fresh[:short], fresh[short:]
            while len(new) < short:
                k = short - len(new)
                new, left[-1] = np.concatenate([new, left[-1][:k]]), left[-1][k:]
                if not len(left[-1]):
                    left.pop()
            selected[leave] = np.concatenate([back, new])
            left.insert(0, gone)
            out[t] = selected
        return out


def lru_misses(sets: np.ndarray, slots: int, first_new: int) -> np.ndarray:
    """int64[steps, rows]: the misses of a plain LRU of ``slots`` units per row, cold at step 0,
    over ``sets`` (``selections``); the decoded token of step t is unit ``first_new + t``, which
    takes a slot that step (never selected later)."""
    steps, rows, _ = sets.shape
    out = np.zeros((steps, rows), dtype=np.int64)
    for r in range(rows):
        lru: OrderedDict = OrderedDict()  # resident units, least recently touched first
        for t in range(steps):
            sel = sets[t, r].tolist()
            out[t, r] = sum(u not in lru for u in sel)
            for u in sel + [first_new + t]:
                lru[u] = None
                lru.move_to_end(u)
            while len(lru) > slots:
                lru.popitem(last=False)
    return out


def fit(K: int = 2048, steps: int = 60, rows: int = 4) -> dict:
    """The steady-state LRU miss rate of ``Reuse()`` at each published slot count (skipping the
    first 20 steps' cold start), for the calibration test and the report."""
    sets, _ = Reuse().selections(1 << 17, K, steps, rows, seed=1)
    return {s: float(lru_misses(sets, s * K // 2048, 1 << 17)[20:].mean() / K) for s in PUBLISHED}
