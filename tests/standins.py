"""Stand-in KV bytes for whole-request tests (test_transfer, test_sinks): every buffer's token
at a position holds bytes that are a function of the buffer and the position only, written
straight to a cache's pages and read back through its views."""
import numpy as np
import torch

import torch_kvcm2 as kv
from configs import import_history

HISTORY = 30


def buffers(config):
    """(key, layer, role, bytes_per_token) of every buffer with pages; key tells buffers apart
    in the stand-in bytes."""
    return [(i * 16 + j, layer.name, buf.role, buf.bytes_per_token)
            for i, layer in enumerate(config.layers) for j, buf in enumerate(layer.buffers)
            if buf.bytes_per_token]


def standin(key, positions, nbytes):
    """The stand-in KV of tokens at ``positions`` of one buffer: uint8[n, nbytes], a function of
    the buffer and the position only."""
    t = torch.as_tensor(positions, dtype=torch.int64)[:, None]
    return ((t * 31 + key * 97 + torch.arange(nbytes) * 7 + 3) % 256).to(torch.uint8)


def synchronize(manager):
    if manager.config.device.type == "cuda":
        torch.cuda.synchronize(manager.config.device)


def live_positions(cache, layer, role, end):
    """Positions below ``end`` whose pages the cache still holds (a window releases pages)."""
    P = cache.manager.config.tokens_per_page
    idx = cache.host_pages(layer, role)
    positions = np.arange(end)
    return positions[idx[positions // P] >= 0]


def token_view(cache, layer, role, positions):
    """(view, page indices, offsets) addressing tokens ``positions`` of one buffer's pages."""
    manager, P = cache.manager, cache.manager.config.tokens_per_page
    view = manager.buffer_view(layer, role, device_side=False)
    positions = torch.as_tensor(positions, dtype=torch.int64)
    pages = torch.from_numpy(cache.host_pages(layer, role))[positions // P]
    assert (pages >= 0).all()
    return view, pages.to(view.device), (positions % P).to(view.device)


def read_tokens(cache, layer, role, positions):
    synchronize(cache.manager)
    view, pages, offsets = token_view(cache, layer, role, positions)
    return view[pages, :, offsets].reshape(len(positions), -1).cpu()


def write_tokens(cache, layer, role, positions, data):
    view, pages, offsets = token_view(cache, layer, role, positions)
    view[pages, :, offsets] = data.view(len(positions), view.shape[1], -1).to(view.device)


def prefilled(manager, history=HISTORY):
    """A detached cache with ``history`` tokens of stand-in bytes on its pages (every buffer)."""
    cache = import_history(manager.create_cache(), history)
    for key, layer, role, nbytes in buffers(manager.config):
        positions = live_positions(cache, layer, role, history)
        write_tokens(cache, layer, role, positions, standin(key, positions, nbytes))
    return cache


def check_tokens(cache, end, source=None):
    """Every live token below ``end`` of every buffer holds its stand-in bytes, and those below
    ``source``'s history equal ``source``'s (another manager's cache) byte for byte."""
    checked = 0
    for key, layer, role, nbytes in buffers(cache.manager.config):
        positions = live_positions(cache, layer, role, end)
        got = read_tokens(cache, layer, role, positions)
        assert torch.equal(got, standin(key, positions, nbytes)), (layer, role)
        if source is not None:
            theirs = live_positions(source, layer, role, source.history_length)
            mine = np.isin(positions, theirs)
            old = positions[mine]
            assert len(old) and torch.equal(got[torch.from_numpy(mine)],
                                            read_tokens(source, layer, role, old)), (layer, role)
        checked += len(positions)
    return checked


def write_cell(cells, at, key, t, nbytes):
    """Token ``t``'s stand-in bytes into cell token index ``at`` of ``cells``."""
    P = cells.shape[2]
    cells[at // P, :, at % P] = standin(key, [t], nbytes).view(cells.shape[1], -1).to(cells.device)


def finish_token(batch, cache, keys, t):
    """The end of a stand-in decode step of token ``t``: its dense buffers' bytes straight to
    their pages (``keys``: (layer, role) -> (key, nbytes)), the flush, and history t + 1."""
    manager = batch.manager
    for (layer, role), (key, nbytes) in keys.items():
        if not manager.buffer(layer, role).sparse:
            write_tokens(cache, layer, role, [t], standin(key, [t], nbytes))
    batch.flush()
    assert cache.resize(history=t + 1)


def decode(batch, cache, steps, choose, after_publish=lambda: None):
    """``steps`` stand-in decode steps of ``cache`` in ``batch``. Per selection group,
    ``choose(group, t)`` gives the unit ordinals to select (int32[K], -1 padding) and a bool[K]
    of those whose entries must read BAD (released units); every other selected unit's cells
    must hold its stand-in bytes after the fetch. The new token's KV goes into the cells
    (sparse) or straight to its pages (dense), then flush and history t + 1 (``finish_token``).
    ``after_publish()`` runs after each step's publish. Returns the tokens checked in cells."""
    config = batch.config
    row, P = batch.row_of(cache), config.tokens_per_page
    keys = {(layer, role): (key, nbytes) for key, layer, role, nbytes in buffers(config)}
    checked = 0
    for _ in range(steps):
        t = cache.history_length
        assert cache.resize(capacity=t + 1)
        batch.publish()
        after_publish()
        for group in config.selection_groups:
            U, K = group.sparse.tokens_per_unit, group.sparse.width
            units, released = choose(group, t)
            selected = torch.full((batch.max_rows, K), -1, dtype=torch.int32)
            selected[row] = units
            index = batch.resolve(group.index, selected.to(config.device)).cpu()
            assert (index[row][released] == kv.BAD).all(), (group.name, t, units, index[row])
            valid = (units >= 0) & ~released
            assert (index[row][valid] >= 0).all(), (group.name, t, units, index[row])
            table, start = batch.write_indices(group.index)
            at = int(table[row, t - int(start[row])])
            for layer in group.layers:
                batch.fetch(layer)
                for role in [b.role for b in config.layer(layer).sparse_buffers]:
                    if (layer, role) not in keys:  # a zero-size buffer
                        continue
                    key, nbytes = keys[(layer, role)]
                    cells = batch.cells(layer, role)
                    tokens = (index[row][valid].long()[:, None] * U + torch.arange(U)).flatten()
                    got = cells[tokens // P, :, tokens % P].reshape(len(tokens), -1).cpu()
                    positions = (units[valid].long()[:, None] * U + torch.arange(U)).flatten()
                    assert torch.equal(got, standin(key, positions, nbytes)), (layer, role)
                    checked += len(tokens)
                    write_cell(cells, at, key, t, nbytes)
        finish_token(batch, cache, keys, t)
    return checked
