"""Shared prefix: 16 agent requests with one long system prompt share its pages.

The first request prefills the system prompt and its own message, then commits its history
(``KVCache.commit``). Every later request starts from ``create_cache(token_ids)``: the system
prompt's pages are shared (nothing copied, nothing recomputed), so it prefills only its own
message. All requests then decode together. The 'model' writes bytes that depend on the token
id, position and layer, so every attention read from the cells checks that a shared page holds
what this request's own prefill would have written. Prints the bytes saved against private
copies and the hit rates (prefix and cells). Runs on CUDA when the extension has CUDA kernels
and a GPU is visible, else on the CPU.

The budgets default to what the run needs: the batch reserve (``memory.batch_reserve_bytes``)
plus the pages of the first request and the private pages of the others; ``--gpu-budget`` and
``--host-budget`` set them. Flags whose run would need more memory than the machine has now are
refused before anything is allocated, naming the flag. Phases that last more than a few seconds
report their progress on stderr.

    python examples/shared_prefix.py [--requests 16] [--prefix 1024] [--private 64] [--steps 4]
                                     [--gpu-budget BYTES] [--host-budget BYTES]
"""
import argparse
import dataclasses
import sys

import torch

import torch_kvcm2 as kv
from torch_kvcm2.memory import batch_reserve_bytes

from flags import (Part, add_device_flag, check_memory, human, pick_device, positive_int,
                   size)  # examples/flags.py
from running import Estimate, Progress  # examples/running.py

P, U, K, S, I, B = 16, 1, 8, 16, 4, 64  # page, unit, width, slots, in-flight tokens, bytes/token
LAYERS = ("layer0", "layer1")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--requests", type=positive_int, default=16, help="requests (batch rows)")
parser.add_argument("--prefix", type=positive_int, default=1024,
                    help="tokens of the shared system prompt")
parser.add_argument("--private", type=positive_int, default=64,
                    help="tokens of each request's own message")
parser.add_argument("--steps", type=positive_int, default=4, help="decode steps")
parser.add_argument("--gpu-budget", type=size, default=argparse.SUPPRESS,
                    help="CacheConfig.gpu_budget_bytes: bytes (K, M, G, T suffixes) for the "
                         "batch's cells and tables (default: what the run needs)")
parser.add_argument("--host-budget", type=size, default=argparse.SUPPRESS,
                    help="CacheConfig.host_budget_bytes: bytes (K, M, G, T suffixes) for the host "
                         "pages and the pinned staging (default: what the run needs)")
add_device_flag(parser)
args = parser.parse_args()
device = pick_device(args.device)
ROWS = args.requests
prompt = args.prefix + args.private
max_tokens = -(-(prompt + args.steps + I) // P) * P
per_token = B * len(LAYERS)
latent = kv.BufferSpec("kv", bytes_per_token=B, sparse=True)
sparse = kv.SparseSpec(tokens_per_unit=U, width=K, slots=S, max_inflight_tokens=I,
                       selection_id="indexer0")
try:  # without budgets first: they depend on the config's batch reserve
    config = kv.CacheConfig(tokens_per_page=P, max_rows=ROWS, max_tokens_per_row=max_tokens,
                            layers=[kv.LayerSpec(n, [latent], sparse=sparse) for n in LAYERS],
                            gpu_budget_bytes=0, host_budget_bytes=0, device=device)
except ValueError as error:
    parser.error(f"argument --prefix/--private/--steps: these lengths make an invalid cache "
                 f"config: {error}")
# the pages the run holds at its end: every page of the first request, and each later request's
# pages after the system prompt's whole pages, which it shares
row_pages = max_tokens // P
pages = row_pages + (ROWS - 1) * (row_pages - args.prefix // P)
reserve = batch_reserve_bytes(config)  # cells, tables, staging: nothing allocated yet
need = {"gpu": reserve["gpu"], "host": reserve["host"] + pages * P * per_token}
for medium in ("gpu", "host"):
    budget = getattr(args, f"{medium}_budget", None)
    if budget is not None and budget < need[medium]:
        parser.error(f"argument --{medium}-budget: {budget} bytes is less than this run needs: "
                     f"{need[medium]} bytes ({human(need[medium])}: the batch reserve of "
                     f"{reserve[medium]} bytes for {ROWS} rows"
                     + (f" and {pages} pages of {P * per_token} bytes)" if medium == "host" else ")"))
tokens_bytes = ROWS * (prompt + args.steps) * 8
check_memory(parser, sys.argv[1:], [
    Part("the cache's host pages", pages * P * per_token,
         ("--requests", "--prefix", "--private", "--steps"), "host"),
    Part("the batch's cells and tables", reserve["gpu"], ("--requests", "--prefix"), "device"),
    Part("the batch's pinned staging", reserve["host"], ("--requests", "--prefix"), "host"),
    Part("the token ids", 2 * tokens_bytes, ("--requests", "--prefix", "--private"), "host"),
    Part("the prefill's positions and indices", 2 * ROWS * prompt * 4,
         ("--requests", "--prefix", "--private"), "device"),
    Part("the prefill's token bytes", prompt * (18 * B + 40), ("--prefix", "--private"), "host"),
], device)
device = device.type
config = dataclasses.replace(
    config, gpu_budget_bytes=getattr(args, "gpu_budget", need["gpu"] + (1 << 20)),
    host_budget_bytes=getattr(args, "host_budget", need["host"] + (1 << 20)))
try:
    manager = kv.KVCacheManager(config)
except ValueError as error:  # a budget below what the batch reserve and one page need (STO-4)
    flag = "--gpu-budget" if "the gpu budget" in str(error) else "--host-budget"
    parser.error(f"argument {flag}: {error}")
batch = kv.Batch(manager)
generator = torch.Generator().manual_seed(0)
system = torch.randint(0, 100_000, (args.prefix,), generator=generator)
tokens = [torch.cat([system, torch.randint(0, 100_000, (args.private,), generator=generator)])
          for _ in range(ROWS)]  # each request's token ids; decode appends to them


def token_bytes(layer: int, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The KV bytes the 'model' writes for tokens ``ids`` at ``positions`` of a layer."""
    return ((ids[:, None] * 3 + positions[:, None] * 7 + layer * 101 + torch.arange(B)) % 251).to(torch.uint8)


def write(target: torch.Tensor, index: torch.Tensor, row: int, positions: torch.Tensor, layer: int):
    """Write request ``row``'s tokens at ``positions`` to token indices ``index`` (BAD skipped)."""
    ok = (index >= 0).cpu()
    index, positions = index.cpu()[ok].long(), positions.cpu()[ok].long()
    data = token_bytes(layer, tokens[row][positions], positions).to(device)
    target[(index // P).to(device), 0, (index % P).to(device)] = data


picks = {}  # per row: the 'indexer's' K units; each step replaces two of them


def select(row: int, h: int) -> torch.Tensor:
    if row not in picks or len(picks[row]) < K:
        picks[row] = torch.randint(0, h, (K,), generator=generator)
    else:
        picks[row] = picks[row].clone()
        picks[row][torch.randperm(K, generator=generator)[:2]] = torch.randint(0, h, (2,), generator=generator)
    return picks[row]


def step(rows, what, flags=("--requests",)):
    """One step of the seated requests ``rows``: publish; resolve K units of history per row
    (most of them the previous step's); fetch; write the new tokens ([history, s0) to host pages, [s0, capacity) to cells); check
    every selected token read from the cells; declare, flush, advance history. Its progress,
    as ``what``, goes to stderr when it lasts (with an estimate naming ``flags`` when it will
    last minutes)."""
    batch.publish()
    members = batch.members()
    shown, done = Progress(what, 2 * len(LAYERS) * len(rows), "rows x layers (write, check)",
                           flags=flags), 0
    selected = torch.full((ROWS, K), -1, dtype=torch.int32)
    for row in rows:
        h = members[row].history_length
        if h:
            selected[row] = select(row, h)
    index = batch.resolve(0, selected.to(device))
    for layer in LAYERS:
        batch.fetch(layer)
    table, start = batch.write_indices(0)
    for i, layer in enumerate(LAYERS):
        for row in rows:
            cache = members[row]
            h, s0 = cache.history_length, int(start[row])
            positions = torch.full((ROWS, max(s0 - h, 1)), -1, dtype=torch.int32)
            positions[row, :s0 - h] = torch.arange(h, s0, dtype=torch.int32)
            host = batch.host_token_indices(layer, "kv", positions.to(device))[row]
            write(manager.buffer_view(layer, "kv"), host, row, positions[row], i)
            write(batch.cells(layer, "kv"), table[row], row, s0 + torch.arange(table.shape[1]), i)
            done += 1
            shown.update(done)
    batch.record_host_writes()
    checked = 0
    for i, layer in enumerate(LAYERS):  # 'attention' reads the selected tokens from the cells
        cells = batch.cells(layer, "kv")
        for row in rows:
            ok = (index[row] >= 0).cpu()
            entry = index[row].cpu()[ok].long()
            units = selected[row][ok].long()
            got = cells[(entry // P).to(device), 0, (entry % P).to(device)].cpu()
            want = token_bytes(i, tokens[row][units], units)
            if not torch.equal(got, want):
                raise SystemExit(f"check failed: row {row} {layer}: a selected token read wrong bytes")
            checked += len(entry)
            done += 1
            shown.update(done)
    batch.flush()
    for row in rows:
        cache = members[row]
        assert cache.resize(history=cache.capacity)
    return checked


# the first request: prefill everything, then offer its history for reuse
first = manager.create_cache(tokens[0])
assert first.reused_tokens == 0
batch.add(first)
assert first.resize(capacity=prompt)
reads = step([0], "prefill of the first request", ("--prefix", "--private"))
committed = first.commit(tokens[0][:first.history_length])
# the others: the system prompt's pages are shared; each prefills only its own message
caches = [first]
seating = Progress("seating the later requests", ROWS - 1, "requests", flags=("--requests",))
for row in range(1, ROWS):
    seating.update(row - 1)
    cache = manager.create_cache(tokens[row])
    batch.add(cache, row=row)
    assert cache.resize(capacity=prompt)
    caches.append(cache)
reused = [c.reused_tokens for c in caches]
# the rest of the run, a request's step at a time: a line with an estimate when it will take
# minutes (a single step that long says so itself, from its progress)
rest = Estimate("the later prefill and the decode steps", ROWS - 1 + args.steps * ROWS,
                "request-steps", flags=("--requests", "--steps"))
if ROWS > 1:
    reads += step(list(range(1, ROWS)), "prefill of the later requests")
    rest.update(ROWS - 1)
for number in range(args.steps):  # decode: one new token per request
    for row, cache in enumerate(caches):
        tokens[row] = torch.cat([tokens[row], torch.randint(0, 100_000, (1,), generator=generator)])
        assert cache.resize(capacity=cache.capacity + 1)
    reads += step(list(range(ROWS)), f"decode step {number + 1} of {args.steps}")
    rest.update(ROWS - 1 + (number + 1) * ROWS)
history = 0
verifying = Progress("verifying the host pages", len(LAYERS) * ROWS, "rows x layers",
                     flags=("--requests",))
for i, layer in enumerate(LAYERS):  # every token of history is on its host pages
    host = manager.slot_pages(layer, "kv", device_side=False)
    for row, cache in enumerate(caches):
        verifying.update(i * ROWS + row)
        pages = torch.tensor(cache.pages(manager.buffer(layer, "kv").pool_group))
        t = torch.arange(cache.history_length)
        if not torch.equal(host[pages[t // P], 0, t % P], token_bytes(i, tokens[row][t], t)):
            raise SystemExit(f"check failed: request {row} {layer}: history on host pages")
        history += len(t)
stats = manager.stats()
used = sum(g["used_bytes"] for g in stats["pool_groups"] if g["sparse"])
shared = sum(g["shared_bytes"] for g in stats["pool_groups"] if g["sparse"])
private = sum(-(-c.capacity // P) for c in caches) * P * per_token  # without sharing
prefix = stats["prefix"]
hits = batch.hit_rate(0)
print(f"device {device}: {ROWS} requests, a {args.prefix}-token system prompt + {args.private} "
      f"own tokens each, {args.steps} decode steps")
print(f"checks passed: {reads} attention reads from the cells and {history} history tokens x "
      f"layer on host pages hold their tokens' bytes")
later = sorted(set(reused[1:])) or [0]
print(f"prefix: committed {committed} tokens; {ROWS - 1} later request(s) reused "
      f"{'..'.join(map(str, later[::max(len(later) - 1, 1)]))} tokens each; "
      f"prefix hit rate {prefix['hit_rate']:.2f} ({prefix['matched_tokens']} of "
      f"{prefix['queried_tokens']} prompt tokens)")
print(f"host bytes: {used:,} B in use ({shared:,} B of pages shared) vs {private:,} B with private "
      f"copies: {100 * (1 - used / private):.0f}% saved")
print(f"cells hit rate {hits['hit_rate']:.2f} ({hits['hits']} hits, {hits['misses']} misses)")
