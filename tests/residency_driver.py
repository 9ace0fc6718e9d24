"""Random per-row evolution of (history, capacity, lease) and selections for op-level residency
sequences, shared by test_residency_ops and test_mtp."""
import random

import reference as ref

BAD = ref.BAD


class RandomDriver:
    """Random per-row evolution of (h, c, lease) and selections, mimicking what a Batch and its
    caches publish: capacity grows by a decode step or a prefill, history advances toward
    capacity (a flush), capacity may shrink back toward history, leases join, leave (after
    h == c), move rows, and a newly granted lease has its residency reset."""

    def __init__(self, seed, U, P, K, I, S, window, leases, rows, max_tokens):
        self.rng = random.Random(seed)
        self.U, self.P, self.K, self.I, self.S = U, P, K, I, S
        self.window, self.leases, self.rows, self.max_tokens = window, leases, rows, max_tokens
        self.h = [0] * rows
        self.c = [0] * rows
        self.lease = [BAD] * rows
        self.free = list(range(leases))

    def evolve(self):
        """Returns the leases granted this step (their residency must be reset)."""
        rng, granted = self.rng, []
        for r in range(self.rows):
            ell = self.lease[r]
            if ell == BAD:
                if self.free and rng.random() < 0.3:
                    ell = self.free.pop(rng.randrange(len(self.free)))
                    self.lease[r] = ell
                    granted.append(ell)
                    self.h[r] = self.c[r] = rng.choice([0, rng.randrange(self.max_tokens // 2)])
                continue
            roll = rng.random()
            if roll < 0.04 and self.h[r] == self.c[r]:
                self.free.append(ell)  # leave (suspend / remove): only with nothing in flight
                self.lease[r] = BAD
                continue
            if self.c[r] > self.h[r] and rng.random() < 0.6:
                self.h[r] = rng.randrange(self.h[r] + 1, self.c[r] + 1)  # flush + advance
            roll = rng.random()
            room = self.max_tokens - self.c[r]
            if roll < 0.55 and room > 0:
                self.c[r] += rng.randint(0, min(room, self.I))  # decode / short prefill
            elif roll < 0.65 and room > 0:
                self.c[r] += rng.randint(1, room)  # long prefill: part goes host-direct
            elif roll < 0.75:
                self.c[r] = rng.randint(self.h[r], self.c[r])  # capacity shrinks back
        if self.rows > 1 and self.rng.random() < 0.1:  # move: swap two rows with their leases
            a, b = self.rng.sample(range(self.rows), 2)
            for arr in (self.h, self.c, self.lease):
                arr[a], arr[b] = arr[b], arr[a]
        return granted

    def published_lease(self):
        # occasionally publish a garbage lease for a hole (bad data: must act like a hole)
        return [self.rng.choice([BAD, BAD, -7, self.leases + 3]) if ell == BAD else ell
                for ell in self.lease]

    def selection(self, resident_rows):
        rng, U = self.rng, self.U
        sel = []
        for r in range(self.rows):
            c = self.c[r]
            top = max(1, ref.ceil_div(c, U) + 2)
            recent = [u for u in resident_rows.get(r, []) if u != BAD]
            row = []
            for _ in range(self.K):
                x = rng.random()
                if x < 0.12:
                    row.append(rng.choice([-1, -1, -3]))  # padding
                elif x < 0.18:
                    row.append(rng.choice([top, top + 5, 2**31 - 1, 2**30]))  # out of range
                elif x < 0.30 and row:
                    row.append(rng.choice(row))  # duplicate
                elif x < 0.60 and recent:
                    row.append(rng.choice(recent))  # likely hit
                else:
                    row.append(rng.randrange(0, top))  # history, in flight or not selectable
            sel.append(row)
        return sel
