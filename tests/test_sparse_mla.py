"""The sparse MLA decode kernel (torch_kvcm2/models/sparse_mla.py, MOD-4) against its definition.

CPU: the torch implementation (what ``sparse_mla_decode`` runs without CUDA or triton) against
``sparse_mla_decode_reference``: bit-identical where both run the same operations (no padding),
within 1e-6 where padding makes the fallback mask instead of filter; all-padding requests give
zeros; the FP8 row format round-trips. CUDA (marked ``cuda``): the Triton kernel against the
fp32 reference within ``tolerance(dtype)``, at DeepSeek-V3.2's shape (128 heads, K = 2048) and
at small odd shapes (padding, K not a multiple of the tile, fewer heads than a tile), every
candidate configuration, FP8 rows, and replayed from a CUDA graph; planted faults (every entry
shifted by one; one entry shifted where K is small) must fail the same check.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE_PARAMS
from torch_kvcm2.models import sparse_mla as mla

ROW, LATENT = mla.ROW, mla.LATENT
SCALE = 192 ** -0.5  # DeepSeek-V3.2's softmax scale (qk_nope 128 + rope 64), before YaRN


def make_inputs(batch, heads, k, n, dtype=torch.float32, device="cpu", pad=0.0, seed=0,
                empty_row=None):
    """Random unit-variance queries and rows; ``k`` distinct entries per request, a fraction
    ``pad`` of them -1, request ``empty_row`` all padding."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, ROW, generator=gen).to(dtype)
    rows = torch.randn(n, ROW, generator=gen).to(dtype)
    indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(batch)])
    indices = indices.to(torch.int32)
    if pad:
        indices[torch.rand(batch, k, generator=gen) < pad] = -1
    if empty_row is not None:
        indices[empty_row] = -1
    return q.to(device), rows.to(device), indices.to(device)


def reference32(q, rows, indices):
    """The definition in fp32 (FP8 rows dequantised first, as the kernel does)."""
    if rows.dtype == torch.uint8:
        rows = mla.dequantize_fp8_rows(rows)
    return mla.sparse_mla_decode_reference(q.float(), rows.float(), indices, SCALE)


def agrees(got, ref, dtype) -> bool:
    atol, rtol = mla.tolerance(dtype)
    return torch.allclose(got.float(), ref.float(), atol=atol, rtol=rtol)


def assert_agrees(got, ref, dtype):
    atol, rtol = mla.tolerance(dtype)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# the torch implementation (CPU) and the definition
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 16, 37, 100), (3, 8, 64, 80), (2, 128, 256, 600)])
def test_torch_is_the_reference_without_padding(shape, dtype):
    """Same operations in the same order: bit-identical."""
    q, rows, indices = make_inputs(*shape, dtype=dtype)
    got = mla.sparse_mla_decode_torch(q, rows, indices, SCALE)
    assert got.dtype == dtype and got.shape == (shape[0], shape[1], LATENT)
    assert torch.equal(got, mla.sparse_mla_decode_reference(q, rows, indices, SCALE))


@pytest.mark.parametrize("shape", [(3, 16, 37, 100), (4, 8, 5, 10), (2, 4, 130, 300)])
def test_torch_matches_reference_with_padding(shape):
    """Padding masked (fallback) instead of filtered (reference): fp32 within 1e-6; a request
    with every entry padded gives exact zeros."""
    q, rows, indices = make_inputs(*shape, pad=0.4, empty_row=1)
    got = mla.sparse_mla_decode_torch(q, rows, indices, SCALE)
    ref = mla.sparse_mla_decode_reference(q, rows, indices, SCALE)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))


def test_reference_is_softmax_attention():
    """The definition spelled out for one request with two valid entries of three."""
    q, rows, _ = make_inputs(1, 2, 3, 5)
    indices = torch.tensor([[4, -1, 1]], dtype=torch.int32)
    kv = rows[[4, 1]]
    weights = torch.softmax(q[0] @ kv.t() * SCALE, dim=-1)
    want = weights @ kv[:, :LATENT]
    torch.testing.assert_close(mla.sparse_mla_decode_reference(q, rows, indices, SCALE)[0],
                               want, atol=1e-6, rtol=1e-6)


def test_dispatch_on_cpu_is_the_torch_path_and_writes_out():
    q, rows, indices = make_inputs(2, 8, 20, 50, pad=0.2)
    out = torch.full((2, 8, LATENT), float("nan"))
    result = mla.sparse_mla_decode(q, rows, indices, SCALE, out=out)
    assert result is out
    assert torch.equal(out, mla.sparse_mla_decode_torch(q, rows, indices, SCALE))


def test_fp8_rows_round_trip_and_decode():
    """quantize -> dequantize stays within e4m3's precision (2^-4 of the group's scale), the
    scales and rope bytes are where the format puts them, and decoding FP8 rows is decoding
    their dequantised rows."""
    q, rows, indices = make_inputs(2, 8, 40, 64, dtype=torch.bfloat16, pad=0.1)
    rows[3] = 0  # an all-zero row: scale 1, values 0
    fp8 = mla.quantize_fp8_rows(rows)
    assert fp8.dtype == torch.uint8 and fp8.shape == (64, mla.FP8_ROW_BYTES)
    back = mla.dequantize_fp8_rows(fp8)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back[:, LATENT:], rows[:, LATENT:])  # rope kept in bf16
    assert torch.equal(back[3], torch.zeros_like(back[3]))
    scales = fp8[:, LATENT:LATENT + 16].view(torch.float32)
    group_max = rows[:, :LATENT].float().abs().view(64, 4, 128).amax(dim=2)
    torch.testing.assert_close(scales[4:], group_max[4:] / 448.0)
    err = (back[:, :LATENT].float() - rows[:, :LATENT].float()).abs().view(64, 4, 128)
    assert bool((err <= scales[:, :, None] * 448.0 / 16 + 1e-6).all())
    got = mla.sparse_mla_decode_torch(q, fp8, indices, SCALE)
    assert torch.equal(got, mla.sparse_mla_decode_torch(q, back, indices, SCALE))


def test_planted_fault_fails_the_check_on_cpu():
    """The check the CUDA tests use catches an off-by-one in the entries."""
    q, rows, indices = make_inputs(2, 16, 64, 200, dtype=torch.bfloat16)
    ref = reference32(q, rows, indices)
    assert agrees(mla.sparse_mla_decode_torch(q, rows, indices, SCALE), ref, torch.bfloat16)
    shifted = (indices + 1) % rows.shape[0]
    assert not agrees(mla.sparse_mla_decode_torch(q, rows, shifted, SCALE), ref, torch.bfloat16)


@pytest.mark.parametrize("bad, match", [
    (lambda q, r, i: (q[..., :500], r, i), "q must be"),
    (lambda q, r, i: (q, r.float(), i), "one dtype"),
    (lambda q, r, i: (q, r, i.long()), "int32"),
    (lambda q, r, i: (q, r, i[:1]), "int32"),
    (lambda q, r, i: (q.float(), mla.quantize_fp8_rows(r), i), "bf16 q"),
    (lambda q, r, i: (q, r[:, :500], i), "rows must be"),
])
def test_bad_arguments_raise(bad, match):
    q, rows, indices = make_inputs(2, 4, 8, 16, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=match):
        mla.sparse_mla_decode(*bad(q, rows, indices), SCALE)


def test_import_does_not_import_triton():
    """Triton is imported on first use of the Triton path, never by importing the module."""
    code = ("import torch_kvcm2, torch_kvcm2.models.sparse_mla as m; "
            "assert m.triton is None and m._KERNELS is None; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_benchmark_refuses_without_a_gpu():
    """benchmarks/bench_attn.py measures nothing on the CPU and says why (exit status 2)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks", "bench_attn.py")
    result = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "CUDA GPU" in result.stderr and "nothing was measured" in result.stderr


# ---------------------------------------------------------------------------------------------
# the Triton kernel (CUDA)
# ---------------------------------------------------------------------------------------------

def needs_triton():
    pytest.importorskip("triton")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_matches_reference(device, dtype):
    """``sparse_mla_decode`` on each device (CPU: torch; CUDA: Triton) within the tolerance,
    with padding, an all-padding request and K not a multiple of any tile."""
    q, rows, indices = make_inputs(3, 16, 77, 300, dtype=dtype, device=device, pad=0.3,
                                   empty_row=2)
    got = mla.sparse_mla_decode(q, rows, indices, SCALE)
    assert got.dtype == dtype and got.device.type == device
    assert_agrees(got, reference32(q, rows, indices), dtype)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_triton_deepseek_shape(batch):
    """128 heads, K = 2048 over scattered rows: the default configuration (split K at these
    batch sizes) within the bf16 tolerance; the dispatcher runs the same kernel."""
    needs_triton()
    q, rows, indices = make_inputs(batch, 128, 2048, 8192, dtype=torch.bfloat16, device="cuda")
    got = mla.sparse_mla_decode_triton(q, rows, indices, SCALE)
    assert_agrees(got, reference32(q, rows, indices), torch.bfloat16)
    assert torch.equal(got, mla.sparse_mla_decode(q, rows, indices, SCALE))


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(mla.CANDIDATE_CONFIGS))
@pytest.mark.parametrize("splits", [1, 5])
def test_triton_candidate_configs(name, splits):
    """Every configuration the benchmark's sweep may pick, direct (one split) and split (5
    splits of uneven length), with padding, an all-padding request, fewer heads than a tile
    and K not a multiple of the tile."""
    needs_triton()
    q, rows, indices = make_inputs(3, 80, 300, 1000, dtype=torch.bfloat16, device="cuda",
                                   pad=0.2, empty_row=0)
    config = dict(mla.CANDIDATE_CONFIGS[name], splits=splits)
    got = mla.sparse_mla_decode_triton(q, rows, indices, SCALE, config=config)
    assert_agrees(got, reference32(q, rows, indices), torch.bfloat16)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.cuda
@pytest.mark.parametrize("heads, k", [(4, 10), (16, 100), (128, 64)])
def test_triton_fp32_and_fp16(heads, k):
    """fp32 (FMA dot) tight against the fp32 reference; fp16 within its tolerance."""
    needs_triton()
    for dtype in (torch.float32, torch.float16):
        q, rows, indices = make_inputs(2, heads, k, 500, dtype=dtype, device="cuda", pad=0.25)
        got = mla.sparse_mla_decode_triton(q, rows, indices, SCALE)
        assert_agrees(got, reference32(q, rows, indices), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 8])
def test_triton_fp8_rows(splits):
    """656-byte FP8 rows dequantised in the kernel: within the bf16 tolerance of the
    reference over the dequantised rows."""
    needs_triton()
    q, rows, indices = make_inputs(2, 128, 512, 2048, dtype=torch.bfloat16, device="cuda",
                                   pad=0.1)
    fp8 = mla.quantize_fp8_rows(rows)
    config = dict(mla.default_config(2, 128, 512, q.device), splits=splits)
    got = mla.sparse_mla_decode_triton(q, fp8, indices, SCALE, config=config)
    assert_agrees(got, reference32(q, fp8, indices), torch.bfloat16)


@pytest.mark.cuda
def test_triton_planted_faults_fail():
    """A test of the test: every entry shifted by one fails the check at DeepSeek's shape; one
    entry shifted fails it where K is small enough for one row to matter."""
    needs_triton()
    q, rows, indices = make_inputs(2, 128, 2048, 8192, dtype=torch.bfloat16, device="cuda")
    ref = reference32(q, rows, indices)
    assert agrees(mla.sparse_mla_decode(q, rows, indices, SCALE), ref, torch.bfloat16)
    shifted = (indices + 1) % rows.shape[0]
    assert not agrees(mla.sparse_mla_decode(q, rows, shifted, SCALE), ref, torch.bfloat16)

    q, rows, indices = make_inputs(2, 16, 4, 64, dtype=torch.bfloat16, device="cuda")
    ref = reference32(q, rows, indices)
    one = indices.clone()
    one[1, 2] = (one[1, 2] + 1) % rows.shape[0]
    assert agrees(mla.sparse_mla_decode(q, rows, indices, SCALE), ref, torch.bfloat16)
    assert not agrees(mla.sparse_mla_decode(q, rows, one, SCALE), ref, torch.bfloat16)


@pytest.mark.cuda
def test_triton_cells_view_and_cuda_graph():
    """Rows as the cells' bf16 view (chunks 1, 1152-byte tokens), entries scattered over them;
    the kernel captured in a CUDA graph (no host synchronisation) and replayed on new data
    gives what an eager call gives."""
    needs_triton()
    cells = torch.zeros(64, 1, 64, ROW * 2, dtype=torch.uint8, device="cuda")
    rows = cells.view(torch.bfloat16).view(-1, ROW)
    q, _, indices = make_inputs(4, 128, 512, rows.shape[0], dtype=torch.bfloat16,
                                device="cuda")
    out = torch.empty(4, 128, LATENT, dtype=torch.bfloat16, device="cuda")
    rows.normal_()
    mla.sparse_mla_decode(q, rows, indices, SCALE, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.sparse_mla_decode(q, rows, indices, SCALE, out=out)
    rows.normal_()
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mla.sparse_mla_decode(q, rows, indices, SCALE))
    assert_agrees(out, reference32(q, rows, indices), torch.bfloat16)
