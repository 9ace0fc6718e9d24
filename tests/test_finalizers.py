"""Finalizers that make CUDA calls (a batch's read-back ring: an event wait and a host-memory
unregistration; the host region's unregistration; a TP rank's leave) run through
``_util.outside_capture``: garbage collection may run them inside a caller's stream capture, where
such a call would invalidate the capture. During a capture they wait, holding their memory, for
the library's next host-side call outside one."""
import gc

import pytest
import torch

import torch_kvcm2 as kv
from torch_kvcm2 import _util


def test_a_release_during_a_capture_waits_for_the_next_call_outside_one(monkeypatch):
    monkeypatch.setattr(_util, "_deferred", [])  # none left by other tests
    calls = []
    release = _util.outside_capture(lambda *args: calls.append(args))
    monkeypatch.setattr(_util, "_capturing", lambda: True)
    release(1, "a")
    release(2, "b")
    assert calls == [] and len(_util._deferred) == 2
    _util.release_deferred()  # still capturing: nothing runs
    assert calls == []
    monkeypatch.setattr(_util, "_capturing", lambda: False)
    _util.release_deferred()
    assert calls == [(1, "a"), (2, "b")] and _util._deferred == []
    release(3, "c")  # outside a capture: at once
    assert calls[-1] == (3, "c") and _util._deferred == []


def make_batch(device):
    sparse = kv.SparseSpec(tokens_per_unit=1, width=4, slots=8, max_inflight_tokens=2)
    layer = kv.LayerSpec("x", [kv.BufferSpec("kv", 8, sparse=True)], sparse=sparse)
    config = kv.CacheConfig(tokens_per_page=4, layers=[layer], max_rows=2,
                            max_tokens_per_row=64, gpu_budget_bytes=1 << 20,
                            host_budget_bytes=1 << 20, device=device)
    manager = kv.KVCacheManager(config)
    return manager, kv.Batch(manager)


@pytest.mark.cuda
def test_a_batch_collected_inside_a_capture_leaves_the_capture_valid():
    """A batch and its manager in a reference cycle, collected by gc inside a capture: the
    capture ends and replays; their releases run at the next Batch(), whose own read-back ring
    then registers (a release that had failed would have left the old ring's range registered
    after its memory went: 'already mapped')."""
    gc.collect()  # other tests' garbage (their CUDA graphs, whose release a capture refuses)
    _util.release_deferred()  # and their deferred releases: none left
    manager, batch = make_batch("cuda")
    batch.cycle = (batch, manager)  # only the cyclic collector frees them
    del manager, batch
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    gc.disable()  # no collection before the capture's
    try:
        with torch.cuda.graph(graph):
            x.add_(1)
            gc.collect()  # the batch's ring and the manager's host region are released here
            x.add_(1)
    finally:
        gc.enable()
    assert len(_util._deferred) >= 1  # they wait, holding their memory
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4
    for _ in range(3):  # the rings of new batches reuse the released memory's addresses
        manager, batch = make_batch("cuda")
        assert _util._deferred == []
        batch.close()
        manager.close()


def test_a_deferred_release_that_raises_is_reported_and_the_rest_still_run(monkeypatch):
    """The host call that releases the deferred calls is not the one that failed: a raising
    release goes to ``sys.excepthook`` (as a finalizer's error does) and the next one runs."""
    monkeypatch.setattr(_util, "_deferred", [])
    calls, reported = [], []

    def broken():
        raise OSError("unregister failed")

    monkeypatch.setattr(_util, "_capturing", lambda: True)
    _util.outside_capture(broken)()
    _util.outside_capture(lambda: calls.append("after"))()
    monkeypatch.setattr(_util, "_capturing", lambda: False)
    monkeypatch.setattr(_util.sys, "excepthook", lambda *info: reported.append(info[1]))
    _util.release_deferred()  # does not raise
    assert calls == ["after"] and _util._deferred == []
    assert len(reported) == 1 and str(reported[0]) == "unregister failed"


def test_a_release_during_a_trace_waits_instead_of_being_traced(monkeypatch):
    """Garbage collection runs finalizers at any allocation, also while opcheck or torch.compile
    traces (make_fx, AOTAutograd: their dispatch modes active), where a finalizer's op call is
    traced into the graph being built instead of run: on CUDA, host_register's unregistration
    recorded into rank_signal's graph during opcheck broke FX's code generation (``KeyError:
    host_register``) in a run of several test files in one process. During a trace a release
    waits, as during a capture, for the library's next host-side call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(_util, "_deferred", [])
    ran = []
    header = torch.zeros(1)
    release = _util.outside_capture(lambda t: ran.append(t.add_(1)))

    def traced(x):
        release(header)  # a finalizer firing mid-trace, writing a tensor as a rank's leave does
        return x + 1

    graph = make_fx(traced)(torch.ones(2))
    assert ran == [] and len(_util._deferred) == 1
    assert "add_" not in graph.code, graph.code
    _util.release_deferred()  # the next host-side call, outside the trace
    assert len(ran) == 1 and header.tolist() == [1.0] and _util._deferred == []
