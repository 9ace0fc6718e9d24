"""MOD-1, MOD-2, MOD-5: transformers' own DeepSeek-V3.2 and GLM-MoE-DSA through torch_kvcm2
(``torch_kvcm2/models``, docs/MODELS.md), against the stock model with its own dense cache.

The bit-for-bit comparisons run a lockstep batch (equal prompt lengths, the same chunks), so the
stock model multiplies matrices of the same shapes as the torch_kvcm2 run: matrix products of
other shapes differ in the last bits. Each reference is teacher-forced on the tokens the run
generated, so one differing token does not hide the rest.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE_PARAMS

transformers = pytest.importorskip("transformers", reason="the [models] extra (transformers)")

import torch_kvcm2 as kv  # noqa: E402
import torch_kvcm2.models as models  # noqa: E402
from torch_kvcm2.models import reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "generate.py")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
ARCHES = ["v32", "glm"]
PROMPT, CHUNK, NEW = 100, 64, 6  # two prefill chunks (64 + 36), then five decode steps
#: the real models' latent row (512 + 64, the sparse_mla kernel's) and indexer key width
REAL_LATENT = models.tiny.REAL_LATENT


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's products are too small to gain from threads; on a busy machine OpenMP
    threads wait on each other for seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_MODELS = {}


def tiny(arch: str, dtype, device: str = "cpu"):
    key = (arch, dtype, device)
    if key not in _MODELS:
        _MODELS[key] = models.tiny_model(arch, dtype=dtype, device=device)
    return _MODELS[key]


def prompts(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 512, (rows, length), generator=torch.Generator().manual_seed(seed))


def lockstep(model, mode="scatter", rows=2, plant=None, **options):
    """A torch_kvcm2 run of ``rows`` equal-length prompts and its stock reference: (our logits
    [steps, R, V], the stock's, our tokens [R, steps]). ``plant(generator)`` may plant a fault
    before the run."""
    batch = prompts(rows, PROMPT)
    gen = models.Generator(model, max_rows=rows, max_tokens_per_row=256, mode=mode,
                           prefill_chunk=CHUNK, record_logits=True, **options)
    requests = [gen.submit(p.tolist(), NEW) for p in batch]
    if plant is not None:
        plant(gen)
    gen.run()
    ours = torch.stack([torch.stack(r.logits) for r in requests], dim=1)  # [steps, R, V]
    tokens = torch.tensor([r.generated for r in requests])
    stock = reference.stock_batch_logits(model, batch, tokens, CHUNK).float()
    gen.close()
    return ours, stock, tokens


# ---- MOD-2: exact where the selected latents go back to their positions ----

@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHES)
def test_scatter_back_is_bit_identical_to_the_stock_dense_cache(arch, dtype, device):
    model = tiny(arch, dtype, device)
    ours, stock, tokens = lockstep(model)
    assert ours.shape == stock.shape == (NEW, 2, model.config.vocab_size)
    if models.stock_caches_latents(model):
        for step in range(NEW):
            assert torch.equal(ours[step], stock[step]), (
                f"step {step}: max |diff| {(ours[step] - stock[step]).abs().max().item():.3g}")
    else:  # transformers 5.17 caches expanded keys: products of other shapes (docs/MODELS.md)
        tolerance = reference.TOLERANCE[dtype]
        assert (ours - stock).abs().max().item() <= tolerance.max_diff
    assert torch.equal(tokens, ours.argmax(-1).T)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHES)
def test_absorbed_path_matches_the_stock_model(arch, dtype, device):
    """fp32: the stock greedy tokens, logits within 1e-4 (~1e-6 measured); bf16: within the
    stated tolerance (reference.TOLERANCE)."""
    model = tiny(arch, dtype, device)
    ours, stock, tokens = lockstep(model, mode="absorbed")
    diff = assert_close_to_stock(ours, stock, tokens, dtype)
    if dtype == torch.float32:
        assert diff.max().item() > 0  # a different computation, not a copy of the stock one


def assert_close_to_stock(ours, stock, tokens, dtype):
    """Logits within the dtype's stated tolerance (reference.TOLERANCE) and, in fp32, the stock
    greedy tokens; returns the absolute differences."""
    tolerance = reference.TOLERANCE[dtype]
    diff = (ours - stock).abs()
    assert diff.max().item() <= tolerance.max_diff
    if tolerance.mean_diff is not None:
        assert diff.mean().item() <= tolerance.mean_diff
    if dtype == torch.float32:
        assert torch.equal(tokens, stock.argmax(-1).T)
    return diff


# ---- the test of the test: a planted fault must fail the comparison ----

def skip_fetch(gen):
    """The first decode step resolves group indexer1 but never fetches its misses: the layer
    reads whatever its cells held (zeros, or an earlier token)."""
    cache, resolve = gen.cache, gen.cache.resolve

    def faulty(group, selected):
        if gen.steps == 2 and group == models.group_id(1):
            return cache.batch.resolve(group, selected, fetch=False)
        return resolve(group, selected)
    cache.resolve = faulty


def stale_cell(gen):
    """At the first decode step layer 2 does not write its new latent into the token's cell:
    the cell keeps what it held, attention reads it, and the flush writes it to host pages."""
    cache, write = gen.cache, gen.cache.write_latents

    def faulty(name, latents, table, start):
        if gen.steps == 2 and name == models.layer_name(2):
            return None
        return write(name, latents, table, start)
    cache.write_latents = faulty


@pytest.mark.parametrize("fault", [skip_fetch, stale_cell], ids=["fetch-skipped", "stale-cell"])
def test_a_planted_fault_fails_the_check(fault):
    model = tiny("v32", torch.float32)
    ours, stock, _ = lockstep(model, plant=fault)
    assert not torch.equal(ours, stock)
    assert (ours - stock).abs().max().item() > reference.TOLERANCE[torch.float32].max_diff


# ---- requests that leave the batch and come back ----

def ragged(gen, seed=0):
    """Three requests of different prompt lengths; the third arrives at step 3."""
    g = torch.Generator().manual_seed(seed)
    return [gen.submit(torch.randint(2, 512, (length,), generator=g).tolist(), new, arrival)
            for length, new, arrival in ((40, 10, 0), (130, 8, 0), (70, 8, 3))]


def uninterrupted(model, **options):
    gen = models.Generator(model, max_rows=3, max_tokens_per_row=256, **options)
    requests = ragged(gen)
    gen.run()
    gen.close()
    return [r.generated for r in requests]


@pytest.mark.parametrize("arch", ARCHES + ["v4"])
def test_a_preempted_request_continues_with_the_same_tokens(arch):
    """Request 1 is suspended with its dense pages offloaded to the host tier mid-decode, the
    others go on, and it resumes three steps later with a fresh, empty lease (DeepSeek-V4:
    every stream, its open windows' entries taken out of flight first)."""
    model = tiny(arch, torch.float32)
    expected = uninterrupted(model)
    gen = models.Generator(model, max_rows=3, max_tokens_per_row=256, host_tier_bytes=1 << 20)
    requests = ragged(gen)
    while len(requests[1].generated) < 3:
        gen.step()
    gen.suspend(requests[1])
    assert requests[1].cache.suspended
    for _ in range(3):
        gen.step()
    assert len(requests[1].generated) == 3  # nothing ran while suspended
    gen.resume(requests[1])
    gen.run()
    assert [r.generated for r in requests] == expected
    m = gen.metrics()
    assert (m["preemptions"], m["offloads"], m["resumes"]) == (1, 1, 1)
    gen.close()


@pytest.mark.parametrize("arch, gpu_history", [
    ("v32", 0), ("glm", 0), ("v32", 4096), ("glm", 4096), ("v4", 0)],
    ids=["v32-offload", "glm-offload", "v32-gpu_history", "glm-gpu_history", "v4-offload"])
def test_an_exported_request_continues_in_a_second_manager(arch, tmp_path, gpu_history):
    """Request 0 is exported mid-decode, saved, loaded and imported into another manager, where
    it finishes while the first generator finishes the others; with GPU-resident history (RSD-1)
    it leaves GPU pages in the first and moves onto them in the second (its history copied in
    from the host pages the import filled); DeepSeek-V4's record holds every stream's
    (``StreamRecord``)."""
    model = tiny(arch, torch.float32)
    expected = uninterrupted(model)
    first = models.Generator(model, max_rows=3, max_tokens_per_row=256,
                             gpu_history_tokens=gpu_history)
    second = models.Generator(model, max_rows=3, max_tokens_per_row=256,
                              gpu_history_tokens=gpu_history)
    requests = ragged(first)
    while len(requests[0].generated) < 4:
        first.step()
    record = first.export(requests[0])
    record.save(tmp_path / "request0.pt")
    second.adopt(requests[0], type(record).load(tmp_path / "request0.pt"))
    while first.pending or second.pending:
        first.step()
        second.step()
    assert [r.generated for r in requests] == expected
    if gpu_history:
        assert second.metrics()["gpu_history"]["promotions"] > 0
    else:
        group = "csa0" if arch == "v4" else models.group_id(0)
        assert second.metrics()["selection_groups"][group]["misses"] > 0
    first.close()
    second.close()


# ---- what is refused ----

def test_an_unsupported_model_is_refused_by_name():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)
    llama = transformers.LlamaForCausalLM(config)
    with pytest.raises(TypeError, match="DeepseekV32ForCausalLM.*not LlamaForCausalLM"):
        models.describe(llama)


def test_an_unsupported_attention_implementation_is_refused():
    model = models.tiny_model("v32", attn_implementation="eager")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2'"):
        models.describe(model)


def test_an_untested_transformers_version_is_refused(monkeypatch):
    model = tiny("v32", torch.float32)
    # the module in sys.modules: transformers may replace its lazy module on first use
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")
    with pytest.raises(RuntimeError, match=r"transformers 5\.99\.0 is untested.*5\.17\.0 and "
                                           r"5\.23\.0"):
        models.describe(model)
    assert models.describe(model, allow_untested=True).arch == "v32"


def test_import_torch_kvcm2_needs_no_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import torch_kvcm2, torch_kvcm2.models as m\n"
            "try:\n    m.import_transformers()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "pip install 'torch_kvcm2[models]'" in out


def test_eager_attention_is_bit_identical_too():
    """The eager attention function takes a float mask (0 / the dtype's min) instead of sdpa's
    bool mask; prepare_step builds the one the configured function takes."""
    model = models.tiny_model("glm", attn_implementation="eager")
    ours, stock, _ = lockstep(model)
    if models.stock_caches_latents(model):
        assert torch.equal(ours, stock)
    else:
        assert (ours - stock).abs().max().item() <= reference.TOLERANCE[torch.float32].max_diff


# ---- MOD-5: the example ----

@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_generate_example_check_passes(arch):
    out = subprocess.run([sys.executable, EXAMPLE, "--check", "--arch", arch],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check passed" in out.stdout
    for line in ("request 0: prompt 37 tokens", "tokens/s", "hit rate", "bytes moved"):
        assert line in out.stdout


def test_generate_example_loads_a_local_checkpoint(tmp_path, capsys):
    """--model DIR: a saved checkpoint directory, loaded without network access."""
    models.tiny_model("glm", seed=3).save_pretrained(tmp_path / "glm")
    import generate  # examples/ is on sys.path (conftest)
    argv = ["--model", str(tmp_path / "glm"), "--prompt-lengths", "30,70", "--new-tokens", "4",
            "--arrivals", "0", "--check"]
    assert generate.main(argv) == 0
    out = capsys.readouterr().out
    assert "GlmMoeDsaForCausalLM from" in out and "check passed" in out


@pytest.mark.parametrize("argv, message", [
    (["--prompt-lengths", "10,x"], "argument --prompt-lengths"),
    (["--new-tokens", "1,2"], "argument --new-tokens: 2 values for 4 prompts"),
    (["--kernel", "sparse_mla"], "argument --kernel"),
    (["--compile", "--graph"], "argument --graph"),
    (["--model", "/nonexistent"], "argument --model"),
    (["--arch", "v4", "--compile"], "argument --compile: not supported with --arch v4"),
    (["--arch", "v4", "--mode", "absorbed"], "argument --mode: not supported with --arch v4"),
])
def test_generate_example_refuses_bad_flags(argv, message, capsys):
    import generate  # examples/ is on sys.path (conftest)
    with pytest.raises(SystemExit) as exit_:
        generate.parse(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_example_refuses_graph_without_a_gpu(capsys, monkeypatch):
    import generate  # examples/ is on sys.path (conftest)
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--graph", "--device", "cpu"])
    assert exit_.value.code == 2
    assert "--graph (CUDA graph replay) needs a GPU" in capsys.readouterr().err


# ---- MOD-3 and MOD-4 on the GPU ----

@pytest.mark.cuda
@pytest.mark.parametrize("how", ["compile", "graph"])
@pytest.mark.parametrize("arch", ARCHES)
def test_compiled_and_captured_decode_give_the_eager_tokens(arch, how):
    """The decode step (model forward, cache work, flush and advance) under
    torch.compile(fullgraph=True), or captured once as a CUDA graph and replayed, across
    requests joining and leaving; the reference is the eager run with the same static key
    length. CUDA only: the first compile takes 2 minutes and more on 2 CPU cores."""
    model = models.tiny_model(arch, device="cuda",
                              experts_implementation=models.tiny.CAPTURABLE_EXPERTS)

    def run(kind):
        gen = models.Generator(model, max_rows=3, max_tokens_per_row=256, static_length=256)
        requests = ragged(gen)
        if kind == "compile":
            gen.compile_decode()
        elif kind == "graph":
            gen.capture_decode()
        gen.run()
        assert gen.metrics()["generator"]["decode"] == {"compile": "compiled"}.get(kind, kind)
        gen.close()
        return [r.generated for r in requests]

    assert run(how) == run("eager")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("kernel", ["sparse_mla", "reference"])
def test_the_sparse_mla_kernel_reads_the_cells_through_the_index_table(kernel, device):
    """The absorbed decode through ``sparse_mla`` (MOD-4) over the cells of a model with the
    real latent row (512 + 64), reading them through the index table as it is, against the
    stock model, as the torch absorbed path is checked (fp32: the stock tokens)."""
    model = models.tiny_model("v32", device=device, **REAL_LATENT)
    ours, stock, tokens = lockstep(model, mode="absorbed", kernel=kernel)
    assert (ours - stock).abs().max().item() <= reference.TOLERANCE[torch.float32].max_diff
    assert torch.equal(tokens, stock.argmax(-1).T)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_triton_kernel_in_bf16_and_fp32(dtype):
    model = models.tiny_model("glm", dtype=dtype, device="cuda", **REAL_LATENT)
    ours, stock, tokens = lockstep(model, mode="absorbed", kernel="sparse_mla")
    assert_close_to_stock(ours, stock, tokens, dtype)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHES)
def test_gpu_resident_history_is_bit_identical_too(arch, dtype, device):
    """RSD-1 on a real model: rows moved onto GPU history pages after their prefill (few hot
    tokens, so the offloading run misses) read through resolve_gpu_history's entries; the
    logits equal the run that offloads every row, bit for bit, with no miss once there; and a
    preempted request comes back onto GPU pages with the same tokens."""
    model = tiny(arch, dtype, device)
    offload, _, tokens = lockstep(model, hot_tokens=64)
    ours, _, gpu_tokens = lockstep(model, hot_tokens=64, gpu_history_tokens=4096)
    assert torch.equal(ours, offload) and torch.equal(gpu_tokens, tokens)
    expected = uninterrupted(model)
    gen = models.Generator(model, max_rows=3, max_tokens_per_row=256, host_tier_bytes=1 << 20,
                           gpu_history_tokens=4096)
    requests = ragged(gen)
    while len(requests[1].generated) < 3:
        gen.step()
    gen.suspend(requests[1])
    for _ in range(2):
        gen.step()
    gen.resume(requests[1])
    gen.run()
    assert [r.generated for r in requests] == expected
    history = gen.metrics()["gpu_history"]
    assert history["promotions"] >= 4 and history["promoted_bytes"] > 0, history
    gen.close()
