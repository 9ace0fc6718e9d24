"""The stand-in model of P-SERVE (benchmarks/serve.py, whose docstring describes it): the bytes
it writes for every token, and its decode step on either side, with the checks each level
makes of what that step read and wrote."""
from __future__ import annotations

import time

import torch

import torch_kvcm2 as kv

from locality import lru_misses
from serve_mla import fp8_keys, fp8_rows
from torch_kvcm2.models.indexer_logits import indexer_logits, indexer_logits_reference
from torch_kvcm2.models.sparse_mla import sparse_mla_decode_reference, tolerance
from topk import topk_indices

WORD = 4  # bytes per int32 word of the stand-in model's KV
SCORE_MASK = (1 << 20) - 1  # a key's score: the low 20 bits of its words' int32 sum
BIAS = 1 << 21  # the query's preference, above any key score
BOOST = torch.finfo(torch.float32).max  # the same over the real indexer's logits (--attention mla)


def pattern(rid: torch.Tensor, pos: torch.Tensor, layer: int, salt: int, words: int) -> torch.Tensor:
    """The stand-in model's bytes of tokens ``pos`` of requests ``rid`` (broadcast) in one layer
    and buffer: int32[..., words], a hash (every byte depends on all four)."""
    x = (rid.long() * 0x9E3779B1 + pos.long() * 0x85EBCA77 + (layer * 0xC2B2AE3D + salt * 0x27D4EB2F))
    x = x[..., None] + torch.arange(words, device=x.device, dtype=torch.int64) * 0x165667B1
    x = (x ^ (x >> 15)) & 0xFFFFFFFF
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    return ((x ^ (x >> 13)) & 0x7FFFFFFF).to(torch.int32)


def token_rows(view: torch.Tensor, pages: torch.Tensor, pos: torch.Tensor) -> tuple:
    """Index of tokens ``pos`` in a paged view ``uint8[n, chunks, P, b]`` through ``pages``
    (a row's page indices of the view, broadcast against ``pos``): (page, token)."""
    P = view.shape[2]
    return pages.gather(-1, (pos // P).long()), (pos % P).long()


def read_tokens(view: torch.Tensor, page: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """int32[..., words] of the tokens at (page, tok) of a paged view, gathered as int32 words
    (a quarter of the elements a byte gather moves: the stand-in reads near a real kernel's
    rate)."""
    return view.view(torch.int32)[page, :, tok].flatten(-2)  # [..., chunks * b/4]


def write_tokens(view: torch.Tensor, page: torch.Tensor, tok: torch.Tensor, words: torch.Tensor) -> None:
    chunks = view.shape[1]
    view.view(torch.int32)[page, :, tok] = words.view(*words.shape[:-1], chunks, -1)


def latent_words(shape, rid: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
    """The stand-in's latent of tokens ``pos`` of requests ``rid`` in one layer: ``pattern``,
    made valid FP8 rows when the attention is DeepSeek-V3.2's (``serve_mla.fp8_rows``)."""
    words = pattern(rid, pos, layer, 0, shape.latent_bytes // WORD)
    return fp8_rows(words) if shape.attention == "mla" else words


def key_words(shape, rid: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
    """The stand-in's indexer key of tokens ``pos`` of requests ``rid`` in one layer:
    ``pattern``, made valid FP8 keys when the indexer is DeepSeek-V3.2's
    (``serve_mla.fp8_keys``)."""
    words = pattern(rid, pos, layer, 1, shape.key_bytes // WORD)
    return fp8_keys(words) if shape.attention == "mla" else words


def key_layout(shape) -> str:
    """How a page of the indexer's pool holds its keys: with DeepSeek-V3.2's indexer the
    engines' page layout (the page's 128-byte FP8 values, then its scales:
    ``torch_kvcm2.models.indexer_logits``), else token by token."""
    return "page" if shape.attention == "mla" else "token"


def _key_words_at(view: torch.Tensor, page: torch.Tensor, tok: torch.Tensor) -> tuple:
    """The page layout's places of the keys of tokens (page, tok) in the paged view
    ``uint8[n, 1, P, b]`` seen as a page's int32 words: (the words, their values' index, their
    scale's index)."""
    P, b = view.shape[2], view.shape[3]
    words = view[:, 0].flatten(1).view(torch.int32)  # a page's P * b / 4 words
    values = b // WORD - 1
    cols = tok[..., None] * values + torch.arange(values, device=view.device)
    return words, (page[..., None], cols), (page, P * values + tok)


def write_keys(shape, view: torch.Tensor, page: torch.Tensor, tok: torch.Tensor,
               words: torch.Tensor) -> None:
    """Write indexer keys ``words`` (int32[..., b/4]: the values' words, then the scale's) of the
    tokens at (page, tok) of the paged view ``uint8[n, 1, P, b]``, in ``key_layout(shape)``."""
    if key_layout(shape) == "token":
        write_tokens(view, page, tok, words)
        return
    flat, values, scale = _key_words_at(view, page, tok)
    flat[values] = words[..., :-1]
    flat[scale] = words[..., -1]


def read_keys(shape, view: torch.Tensor, page: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """The indexer keys ``write_keys`` wrote at (page, tok): int32[..., b/4]."""
    if key_layout(shape) == "token":
        return read_tokens(view, page, tok)
    flat, values, scale = _key_words_at(view, page, tok)
    return torch.cat([flat[values], flat[scale][..., None]], dim=-1)


class DecodeStep:
    """The device part of one decode step (fixed shapes, capturable): per layer the weights'
    GEMM, the indexer, the cache's resolve + fetch (torch_kvcm2), the new token's KV written,
    attention's gather; then flush (torch_kvcm2) and advance."""

    def __init__(self, side: Side, batch, members: list, overlap: bool = False):
        sh, dev, rows = side.shape, side.device, len(members)
        self.side, self.batch, self.shape, self.rows = side, batch, sh, rows
        self.kvcm2 = side.side == "kvcm2"
        self.fetches = kv.FetchStream(batch) if overlap and self.kvcm2 else None
        self.index, self.write_entry = {}, {}  # per selection group, this step's tables
        self.rid = torch.arange(rows, device=dev, dtype=torch.int32)  # request i sits at row i
        for i, cache in enumerate(members):
            assert batch.row_of(cache) == i
        self.started = [cache.history_length for cache in members]
        P = sh.page
        self.span = side.context + sh.output  # positions the indexer scores (masked by length)
        self.npages = -(-self.span // P)
        self.views, self.pages, self.keys, self.key_slots = {}, {}, {}, {}
        for name in side.names:
            for role in ("kv", "ik"):
                info = side.manager.buffer(name, role)
                scale = info.scale
                table = batch.page_table(name, role)[:rows, :self.npages].long()
                slots = torch.where(table >= 0, table, 0)  # pages past the reserve: never read
                # a row's page indices in the buffer's view (slot x scale + the buffer's place)
                self.pages[name, role] = slots * scale + info.pos
                self.views[name, role] = view = side.manager.buffer_view(name, role)
                if role == "ik":  # the indexer reads this buffer's pages of the slots in use
                    self.keys[name] = view[info.pos::scale][:int(slots.max()) + 1]
                    self.key_slots[name] = slots
        # the locality model's selections, one set per step the level runs (benchmarks/locality.py)
        sets, self.pattern_of = sh.reuse.selections(side.context, sh.top_k, sh.level_steps, rows,
                                                    seed=7 + rows)
        self.sets = torch.as_tensor(sets, device=dev)  # int32[steps, R, K]
        self.model_misses = lru_misses(sets[:, :self.pattern_of.max() + 1], sh.slots,
                                       first_new=side.context)  # [steps, patterns]
        self.counter = torch.zeros((), dtype=torch.int64, device=dev)  # steps run, on the device
        self.ones = torch.ones(rows, dtype=torch.int32, device=dev)
        # the weights' GEMM over the batch padded to a multiple of 8 columns, as engines pad the
        # batch sizes they capture: an output whose rows are not 16-byte aligned (17 or 66
        # requests) falls off cuBLAS's tensor-core kernels (P-SERVE, H100, 2026-12-07: the
        # weights took 5.6 ms at 17 requests and 2.2 at 16); the bytes read are the rows' own
        self.x = torch.ones(sh.hidden, -(-rows // 8) * 8, dtype=torch.bfloat16, device=dev)
        wrows = sh.weight_bytes(rows) // 2 // sh.hidden
        self.wviews = [w[:wrows] for w in side.weights]
        self.out = torch.zeros(sh.layers, rows, dtype=torch.int32, device=dev)
        self.mla = side.mla  # DeepSeek-V3.2's attention modules (--attention mla) or None
        # the kernel reads a buffer's tokens as rows of one [N, latent_bytes] view: one chunk
        assert not self.mla or all(self.views[name, "kv"].shape[1] == 1 for name in side.names)
        self.hidden = self.mla.hidden(rows, dev) if self.mla else None
        if self.mla:  # the indexer's logits, and the query LoRA's output per layer
            assert all(self.views[name, "ik"].shape[1] == 1 for name in side.names)
            self.logits = torch.empty(rows, self.npages * P, dtype=torch.float32, device=dev)
            self.resid = {}
        # layer -> of the last step (checked layers): int32[R, K, words] gathered, or with the
        # modules (the absorbed query, the kernel's output latents)
        self.gathered = {}
        self.selection = {}  # layer -> int64[R, K] positions of the last step
        self.checked = (side.names[0], side.names[-1])
        self.positions = torch.arange(self.npages * P, device=dev)

    def __call__(self) -> None:
        self.run(None)

    def run(self, timer) -> None:
        """One step; ``timer(part)`` marks the start of each part when timing parts. With a
        ``FetchStream``, layer l+1's indexer, resolve and fetch (forked to the side stream) are
        issued before layer l's attention, which waits for its own fetch: one layer of
        lookahead, the stand-in's indexer reading only the keys."""
        sh, batch, names = self.shape, self.batch, self.side.names
        mark = timer or (lambda part: None)
        history = batch.history[:self.rows]
        pos = history.long()  # the new token's position, per row
        chosen = self.sets.index_select(0, self.counter.remainder(len(self.sets)).view(1))[0].long()
        if not self.mla:  # the stand-in's scores: the selection as a bias, the rest masked
            bias = torch.zeros(self.rows, self.npages * sh.page, dtype=torch.int32, device=pos.device)
            bias.scatter_(1, chosen, BIAS)
            dead = self.positions[None, :] >= pos[:, None]  # not history
        selected = {}

        def index(li):
            """Layer li's indexer, the new token's key, and (torch_kvcm2) its group's resolve
            with the fetch of its misses, at the group's first layer."""
            name = names[li]
            mark("indexer")
            if self.mla:  # DeepSeek-V3.2's indexer over every key of the rows' pages
                rows_scores = self.logits
                self.resid[name] = self.mla.index(li, self.hidden, self.views[name, "ik"][:, 0],
                                                  self.pages[name, "ik"], history, rows_scores,
                                                  key_layout(sh))
                rows_scores.scatter_(1, chosen, BOOST)
            else:  # every key of the slots in use read once (this level's requests own them all)
                scores = self.keys[name].view(torch.int32).sum(dim=(1, 3), dtype=torch.int32) & SCORE_MASK
                rows_scores = scores[self.key_slots[name]].flatten(1)  # [R, npages*P], a new tensor
                rows_scores.add_(bias).masked_fill_(dead, -1)
            if sh.topk_kind == "radix":  # the same on both sides
                selected[name] = topk_indices(rows_scores, sh.top_k)
            else:
                # in position order, as the radix select's: the resolve's LRU orders units
                # touched in one step by column, and the locality model's LRU by position
                top = rows_scores.topk(sh.top_k, dim=1, sorted=False).indices
                selected[name] = top.sort(dim=1).values
            mark("cache")
            page, tok = token_rows(self.views[name, "ik"], self.pages[name, "ik"], pos[:, None])
            write_keys(sh, self.views[name, "ik"], page[:, 0], tok[:, 0],
                       key_words(sh, self.rid, pos, li))
            group = self.side.config.group_of(name) if self.kvcm2 else None
            if group is not None and group.layers[0] == name:
                g = group.index
                self.index[g] = batch.resolve(g, selected[name].to(torch.int32),
                                              fetch=self.fetches is None)
                self.write_entry[g] = batch.write_indices(g)[0][:, 0]
                if self.fetches is not None:
                    self.fetches.fetch(*group.layers)  # on the side stream

        if self.fetches is not None:
            index(0)
        for li, name in enumerate(names):
            mark("weights")
            torch.mm(self.wviews[li], self.x)
            if self.fetches is None:
                index(li)
            elif li + 1 < len(names):
                index(li + 1)  # its misses in flight while this layer attends
            mark("cache")
            new_kv = latent_words(sh, self.rid, pos, li)
            if self.kvcm2:
                g = self.side.config.group_of(name).index
                if self.fetches is not None:
                    self.fetches.wait(name)
                cells = batch.cells(name, "kv")
                entry = self.write_entry[g].long()
                write_tokens(cells, entry // sh.page, entry % sh.page, new_kv)
                mark("attention")
                if self.mla:  # the kernel reads the cells through the index table
                    got = self.mla.attend(li, self.hidden, self.resid[name],
                                          cells.view(-1, sh.latent_bytes), self.index[g])[:2]
                else:
                    e = self.index[g].long()
                    got = read_tokens(cells, e // sh.page, e % sh.page)  # [R, K, words]
            else:
                view = self.views[name, "kv"]
                page, tok = token_rows(view, self.pages[name, "kv"], pos[:, None])
                write_tokens(view, page[:, 0], tok[:, 0], new_kv)
                mark("attention")
                page, tok = token_rows(view, self.pages[name, "kv"], selected[name])
                if self.mla:  # the kernel reads the pool through the page table
                    got = self.mla.attend(li, self.hidden, self.resid[name],
                                          view.view(-1, sh.latent_bytes),
                                          (page * sh.page + tok).to(torch.int32))[:2]
                else:
                    got = read_tokens(view, page, tok)
            if not self.mla:
                self.out[li] = got.sum(dim=(1, 2), dtype=torch.int32)
            if name in self.checked:
                self.gathered[name] = got
                self.selection[name] = selected[name]
        mark("cache")
        if self.fetches is not None:
            self.fetches.join()  # every fetch before the flush and the next step's resolves
        if self.kvcm2:
            batch.flush(batch.history + 1)
        batch.advance(self.ones)
        self.counter += 1

    def parts(self, batch) -> dict:
        """One eager step timed by part (ms; CUDA events on the GPU)."""
        cuda = self.side.device == "cuda"
        marks = []

        def timer(part):
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append((part, event))
            else:
                marks.append((part, time.perf_counter()))
        batch.publish()
        self.run(timer)
        timer("end")
        if cuda:
            torch.cuda.synchronize()
        if cuda:
            batch.record_advance()
        totals: dict = {}
        for (part, a), (_, b) in zip(marks, marks[1:]):
            ms = a.elapsed_time(b) if cuda else (b - a) * 1e3
            totals[part] = totals.get(part, 0.0) + ms
        return totals

    def check(self, batch) -> int:
        """The checks of the module docstring for this level; returns the tokens compared."""
        sh, side = self.shape, self.side
        checked = 0
        last = (self.counter - 1).remainder(len(self.sets))
        want_sel = self.sets[int(last)].long().sort(1).values
        for li, name in enumerate(side.names):
            if name not in self.checked:
                continue
            sel = self.selection[name]
            assert torch.equal(sel.sort(1).values, want_sel), f"{name}: the indexer's top-K is not the selection"
            want = latent_words(sh, self.rid[:, None], sel, li)
            if self.mla:  # the kernel's output against the reference over the rows written
                query, latent = self.gathered[name]
                rows = want.reshape(-1, want.shape[-1]).view(torch.uint8)  # [R*K, 656]
                ref = sparse_mla_decode_reference(
                    query, rows, torch.arange(rows.shape[0], device=rows.device,
                                              dtype=torch.int32).view(sel.shape),
                    self.mla.modules[li].scaling)
                atol, rtol = tolerance(torch.bfloat16)
                assert torch.allclose(latent.float(), ref.float(), atol=atol, rtol=rtol), \
                    f"{name}: attention over the selected rows differs from the reference"
            else:
                assert torch.equal(self.gathered[name], want), f"{name}: attention read wrong bytes"
            checked += sel.numel()
        if self.mla:  # the indexer's kernel over the pool, now, against the definition
            li, name = 0, side.names[0]
            q, weights, _ = self.mla.indexer_inputs(li, self.hidden)
            args = (self.views[name, "ik"][:, 0], self.pages[name, "ik"], self.batch.history[:self.rows])
            got = indexer_logits(q, weights, *args, layout=key_layout(sh))
            some = torch.tensor([0, self.rows - 1], device=q.device).unique()
            want = indexer_logits_reference(q[some], weights[some], args[0], args[1][some],
                                            args[2][some], layout=key_layout(sh))
            scale = float(want[want.isfinite()].abs().max())
            assert torch.equal(got[some].isinf(), want.isinf()) and torch.allclose(
                got[some], want, rtol=1e-5, atol=1e-5 * scale), f"{name}: the indexer's logits differ from the definition"
        # every decoded token reached its pages (host pages on torch_kvcm2's side), bit for bit
        start = side.context  # every token decoded so far, this level's and earlier levels'
        for r, cache in enumerate(side.caches[:self.rows]):
            end = cache.history_length
            assert end == self.started[r] + int(self.counter), "a row did not advance every step"
            pos = torch.arange(start, end, device=side.device)
            for li, name in enumerate(side.names):
                if name not in self.checked:
                    continue
                view = side.manager.buffer_view(name, "kv")
                pages = torch.as_tensor(cache.host_pages(name, "kv"), device=side.device)
                page, tok = token_rows(view, pages, pos)
                got = read_tokens(view, page, tok)
                assert torch.equal(got, latent_words(sh, torch.tensor(r), pos, li)), \
                    f"row {r} {name}: a decoded token's latent on its pages differs"
                view = side.manager.buffer_view(name, "ik")  # and its key, in the pool's layout
                pages = torch.as_tensor(cache.host_pages(name, "ik"), device=side.device)
                page, tok = token_rows(view, pages, pos)
                assert torch.equal(read_keys(sh, view, page, tok), key_words(sh, torch.tensor(r), pos, li)), \
                    f"row {r} {name}: a decoded token's indexer key on its pages differs"
                checked += len(pos)
        return checked
