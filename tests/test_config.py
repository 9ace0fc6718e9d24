"""Configuration (REQUIREMENTS §3): a valid config, the derived selection groups, one test per CFG rule.

User-facing error messages are pinned with expecttest; refresh them with
``EXPECTTEST_ACCEPT=1 pytest tests/test_config.py`` and read the diff: every message must name
the layer, the buffer (where one is involved) and the rule id.
"""
import dataclasses
import re

import pytest
import torch
from expecttest import assert_expected_inline

import torch_kvcm2
from torch_kvcm2 import KVCacheManager, missing_for
from torch_kvcm2.config import BufferSpec, CacheConfig, LayerSpec, SelectionGroup, SparseSpec

TOKENS_PER_PAGE = 64
MAX_ROWS = 8
SEE = " (see docs/REQUIREMENTS.md)"  # every config error says where its rule ids are defined

# DeepSeek-V3.2-like: a dense indexer key cache (128 fp8 + one fp32 scale) next to the sparse
# 656-byte MLA latent rows; a token-level top-2048 indexer shared by the "dsa" layers.
INDEXER_K = BufferSpec("indexer_k", 132)
LATENT = BufferSpec("latent", 656, sparse=True)
DSA = SparseSpec(tokens_per_unit=1, width=2048, slots=2176, max_inflight_tokens=64,
                 selection_id="dsa")  # 2176 = 34 pages >= 2048 + 64 + 1
# A private block-sparse layer: E = 4, 68 >= 64 + ceil(32 / 16) + 1 = 67.
PRIVATE = SparseSpec(tokens_per_unit=16, width=64, slots=68, max_inflight_tokens=32)
# An explicit id spelled like the private layer's name "P": E = 1, 11 = 8 + ceil(100 / 64) + 1.
NAMED_LIKE_P = SparseSpec(tokens_per_unit=64, width=8, slots=11, max_inflight_tokens=100,
                          selection_id="P")


def valid_layers() -> list:
    return [
        LayerSpec("L0", [INDEXER_K, LATENT], sparse=DSA),
        LayerSpec("L1", [INDEXER_K, LATENT], sparse=DSA),
        # private sparse layer with a zero-size dense buffer (CFG-6)
        LayerSpec("P", [LATENT, BufferSpec("sink", 0)], sparse=PRIVATE),
        # windowed dense layer, head-major K/V: 8 heads x 128 dims x bf16
        LayerSpec("swa", [BufferSpec("k", 2048, chunks=8), BufferSpec("v", 2048, chunks=8)],
                  window=128),
        LayerSpec("L2", [INDEXER_K, LATENT], sparse=DSA),
        LayerSpec("X", [LATENT], sparse=NAMED_LIKE_P),
    ]


def make_config(layers=None, **changes) -> CacheConfig:
    kwargs = dict(
        tokens_per_page=TOKENS_PER_PAGE,
        layers=valid_layers() if layers is None else layers,
        max_rows=MAX_ROWS,
        max_tokens_per_row=131072,
        gpu_budget_bytes=1 << 30,
        host_budget_bytes=1 << 34,
    )
    kwargs.update(changes)
    return CacheConfig(**kwargs)


def error(layers=None, **changes) -> str:
    """The message of the ValueError (and nothing else) that constructing the config raises;
    ``layers`` given as a function is called inside, so that a spec that refuses its own fields
    when it is made (``with_buffer(...)`` of a bad value) raises there too."""
    return error_of(lambda: make_config(layers() if callable(layers) else layers, **changes))


def error_of(build) -> str:
    """The message of the ValueError (and nothing else) that calling ``build()`` raises, which
    must end by saying where its requirement ids are defined; returned without that ending."""
    with pytest.raises(ValueError) as info:
        build()
    assert type(info.value) is ValueError
    message = str(info.value)
    assert message.endswith(SEE), message
    return message[:-len(SEE)]


def with_layer(name: str, **changes) -> list:
    """The valid layers with layer ``name`` replaced by a copy with ``changes``."""
    layers = valid_layers()
    assert name in [layer.name for layer in layers]
    return [dataclasses.replace(l, **changes) if l.name == name else l for l in layers]


def with_sparse(name: str, **changes) -> list:
    """The valid layers with the sparse settings of layer ``name`` changed."""
    sparse = next(l.sparse for l in valid_layers() if l.name == name)
    return with_layer(name, sparse=dataclasses.replace(sparse, **changes))


def with_buffer(name: str, role: str, **changes) -> list:
    """The valid layers with buffer ``role`` of layer ``name`` changed."""
    buffers = next(l.buffers for l in valid_layers() if l.name == name)
    assert role in [b.role for b in buffers]
    return with_layer(
        name, buffers=[dataclasses.replace(b, **changes) if b.role == role else b for b in buffers])


def one_layer(sparse: SparseSpec, buffers=(LATENT,), window=None) -> list:
    return [LayerSpec("only", list(buffers), window=window, sparse=sparse)]


# ---------------------------------------------------------------- a valid config


def test_valid_config_constructs_with_lists_stored_as_tuples():
    config = make_config()
    assert isinstance(config.layers, tuple)
    assert all(isinstance(layer.buffers, tuple) for layer in config.layers)
    assert [layer.name for layer in config.layers] == ["L0", "L1", "P", "swa", "L2", "X"]
    assert config.layer("L1").buffers == (INDEXER_K, LATENT)
    assert config.layer("L1").sparse_buffers == (LATENT,)
    assert config.layer("swa").sparse_buffers == ()
    assert config.layer("swa").window == 128
    assert config.device == torch.device("cpu")
    assert config.max_pages_per_row == 131072 // TOKENS_PER_PAGE


def test_config_is_frozen_and_hashable():
    config = make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_rows = 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.layers[0].name = "renamed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.layers[0].buffers[0].bytes_per_token = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.layers[0].sparse.width = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.selection_groups[0].layers = ()
    twin = make_config()  # built from fresh lists
    assert twin == config and hash(twin) == hash(config)
    assert len({config, twin, make_config(max_rows=MAX_ROWS + 1)}) == 2
    assert make_config(max_rows=MAX_ROWS + 1) != config


def test_selection_groups_shared_private_and_explicit_id_equal_to_a_layer_name():
    config = make_config()
    groups = config.selection_groups
    assert all(isinstance(g, SelectionGroup) for g in groups)
    # one group per indexer, numbered in order of first appearance; dense "swa" has none
    assert [(g.index, g.key, g.layers) for g in groups] == [
        (0, ("id", "dsa"), ("L0", "L1", "L2")),  # shared id: one group, layers in config order
        (1, ("layer", "P"), ("P",)),  # no selection_id: a private group
        (2, ("id", "P"), ("X",)),  # explicit id "P" does not join layer P's private group
    ]
    assert [g.name for g in groups] == ["dsa", "<layer P>", "P"]
    assert [g.sparse for g in groups] == [DSA, PRIVATE, NAMED_LIKE_P]
    assert [g.units_per_page for g in groups] == [64, 4, 1]
    assert all(g.window is None and g.tokens_per_page == TOKENS_PER_PAGE for g in groups)
    for name in ("L0", "L1", "L2"):
        assert config.group_of(name) is groups[0]
    assert config.group_of("P") is groups[1]
    assert config.group_of("X") is groups[2]


def test_private_groups_are_never_shared():
    same = dataclasses.replace(PRIVATE)  # equal settings, no id: still two groups
    config = make_config([LayerSpec(name, [LATENT], sparse=same) for name in ("a", "b")])
    assert [(g.key, g.layers) for g in config.selection_groups] == [
        (("layer", "a"), ("a",)), (("layer", "b"), ("b",))]


def test_windowed_sparse_group_carries_its_window():
    layers = [LayerSpec(n, [LATENT], window=4096, sparse=DSA) for n in ("w0", "w1")]
    (group,) = make_config(layers).selection_groups
    assert group.layers == ("w0", "w1") and group.window == 4096


def test_max_total_input_tokens_default_and_explicit():
    # default: max_rows x the widest in-flight range, I + U - 1 (100 + 64 - 1, layer X)
    assert make_config().max_total_input_tokens == MAX_ROWS * 163
    only_dsa = [LayerSpec("L0", [INDEXER_K, LATENT], sparse=DSA)]
    assert make_config(only_dsa).max_total_input_tokens == MAX_ROWS * 64
    assert make_config(only_dsa, max_total_input_tokens=5).max_total_input_tokens == 5


def test_device_is_normalised_to_torch_device():
    assert make_config(device="cpu").device == torch.device("cpu")
    assert make_config(device=torch.device("cpu")).device == torch.device("cpu")
    assert make_config(device="cuda:1").device == torch.device("cuda", 1)  # validated, not opened


# ---------------------------------------------------------------- the device
# A config names its device without opening it: configs are built on a control host and shipped
# to the GPU hosts. The manager, which allocates on it, refuses a device this process cannot use
# and says what is missing (docs/DESIGN.md, "A config names its device; the manager opens it").


@pytest.mark.skipif(not missing_for("cuda"), reason="needs a process that cannot use CUDA")
def test_manager_refuses_an_unusable_cuda_device_naming_what_is_missing():
    config = make_config(device="cuda")  # builds, here too
    with pytest.raises(RuntimeError) as info:
        KVCacheManager(config)  # before anything is allocated: the host budget is 16 GiB
    message = str(info.value)
    assert message.startswith("KVCacheManager(): the config's device 'cuda' cannot be used in "
                              "this process: "), message
    assert message.endswith('Build the config with device="cpu" to run on the CPU'), message
    for phrase in missing_for("cuda"):
        assert phrase in message, message
    assert ("CPU-only build" in message) == (torch.version.cuda is None), message
    assert ("built without CUDA kernels" in message) == (not torch_kvcm2.has_cuda_kernels())


def test_missing_for_names_each_missing_part(monkeypatch):
    util = torch_kvcm2._util
    assert missing_for("cpu") == [] and missing_for(torch.device("cpu")) == []
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(util, "has_cuda_kernels", lambda: False)
    assert_expected_inline(
        "\n".join(missing_for("cuda")).replace(torch.__version__, "<version>"),
        """\
torch <version> is a CPU-only build (torch.version.cuda is None)
the torch_kvcm2 extension was built without CUDA kernels (torch_kvcm2.has_cuda_kernels() is False: build it with a CUDA torch and toolkit, TORCH_KVCM2_CUDA=1)""",
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA torch on a host without a GPU
    monkeypatch.setattr(util, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert missing_for("cuda:0") == [
        "no CUDA device is visible (torch.cuda.is_available() is False)"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert missing_for("cuda") == missing_for("cuda:1") == []
    assert missing_for("cuda:2") == ["there is no device cuda:2 (2 CUDA device(s) visible)"]


# ---------------------------------------------------------------- each spec checks its fields


def test_specs_refuse_bad_fields_when_they_are_made():
    assert_expected_inline(
        error_of(lambda: BufferSpec("kv", bytes_per_token=-1)),
        """buffer 'kv': CFG-1: bytes_per_token must be a non-negative int, got -1""",
    )
    assert_expected_inline(
        error_of(lambda: BufferSpec("kv", bytes_per_token=6.5)),
        """buffer 'kv': CFG-1: bytes_per_token must be a non-negative int, got 6.5""",
    )
    assert_expected_inline(
        error_of(lambda: BufferSpec(None, 8)),
        """buffer: CFG-1: a buffer role must be a non-empty str, got None""",
    )
    assert_expected_inline(
        error_of(lambda: SparseSpec(tokens_per_unit=1, width=0, slots=16, max_inflight_tokens=4)),
        """sparse settings: CFG-3: width must be a positive int, got 0""",
    )
    assert_expected_inline(
        error_of(lambda: SparseSpec(1, 8, False, 4, selection_id="g0")),
        """sparse settings of selection_id 'g0': CFG-3: slots must be a positive int, got False""",
    )
    assert_expected_inline(
        error_of(lambda: SparseSpec(1, 8, 16, 2, max_query_tokens=3)),
        """sparse settings: MTP-1: max_inflight_tokens (2) must be >= max_query_tokens (3): every query token of a step is in flight""",
    )
    assert_expected_inline(
        error_of(lambda: LayerSpec("L0", [])),
        """layer 'L0': CFG-1: a layer needs at least one buffer""",
    )
    assert_expected_inline(
        error_of(lambda: LayerSpec("L0", [INDEXER_K], window=-1)),
        """layer 'L0': CFG-1: window must be a positive int or None, got -1""",
    )
    assert_expected_inline(
        error_of(lambda: LayerSpec("L0", [INDEXER_K, "latent"])),
        """layer 'L0': CFG-1: buffers must be BufferSpec, got str""",
    )
    # a zero-size buffer and the smallest sparse settings are fine
    assert BufferSpec("sink", 0).bytes_per_token == 0
    assert SparseSpec(1, 1, 3, 1).max_inflight_units == 2


# ---------------------------------------------------------------- lookups


def test_unknown_layer_raises_key_error():
    config = make_config()
    with pytest.raises(KeyError) as info:
        config.layer("nope")
    assert_expected_inline(str(info.value), """"unknown layer 'nope'\"""")
    with pytest.raises(KeyError) as info:
        config.group_of("nope")
    assert_expected_inline(str(info.value), """"unknown layer 'nope'\"""")


def test_dense_only_layer_has_no_group():
    config = make_config()
    with pytest.raises(KeyError) as info:
        config.group_of("swa")
    assert_expected_inline(
        str(info.value),
        """"layer 'swa' has no sparse buffers, hence no selection group\"""",
    )


# ---------------------------------------------------------------- CFG-1


def test_cfg1_non_positive_tokens_per_page():
    assert_expected_inline(
        error(tokens_per_page=0),
        """config: CFG-1: tokens_per_page must be a positive int, got 0""",
    )


def test_cfg1_non_positive_max_rows():
    assert_expected_inline(
        error(max_rows=-1),
        """config: CFG-1: max_rows must be a positive int, got -1""",
    )


def test_cfg1_non_positive_max_tokens_per_row():
    assert_expected_inline(
        error(max_tokens_per_row=0),
        """config: CFG-1: max_tokens_per_row must be a positive int, got 0""",
    )


def test_cfg1_max_tokens_per_row_fits_int32():
    make_config(max_tokens_per_row=2**31 - 1)
    assert_expected_inline(
        error(max_tokens_per_row=2**31),
        """config: CFG-1: max_tokens_per_row must fit int32, got 2147483648""",
    )


def test_cfg1_negative_gpu_budget():
    make_config(gpu_budget_bytes=0)  # zero is a valid (empty) budget
    assert_expected_inline(
        error(gpu_budget_bytes=-1),
        """config: CFG-1: gpu_budget_bytes must be a non-negative int, got -1""",
    )


def test_cfg1_negative_host_budget():
    make_config(host_budget_bytes=0)
    assert_expected_inline(
        error(host_budget_bytes=-1),
        """config: CFG-1: host_budget_bytes must be a non-negative int, got -1""",
    )


def test_cfg1_no_layers():
    assert_expected_inline(error([]), """config: CFG-1: at least one layer is required""")


def test_cfg1_duplicate_layer_names():
    layers = valid_layers()
    layers.append(dataclasses.replace(layers[3]))  # a second "swa"
    assert_expected_inline(error(layers), """layer 'swa': CFG-1: layer names must be unique""")


def test_cfg1_duplicate_roles_in_a_layer():
    assert_expected_inline(
        error(lambda: with_layer("L1", buffers=[INDEXER_K, LATENT, BufferSpec("latent", 512)])),
        """layer 'L1', buffer 'latent': CFG-1: buffer roles must be unique within a layer""",
    )
    # the same role in different layers is the normal case
    assert make_config().layer("L0").buffers[1].role == make_config().layer("L1").buffers[1].role


def test_cfg1_negative_bytes_per_token():
    assert_expected_inline(
        error(lambda: with_buffer("L1", "indexer_k", bytes_per_token=-1)),
        """buffer 'indexer_k': CFG-1: bytes_per_token must be a non-negative int, got -1""",
    )


def test_cfg1_page_of_a_buffer_fits_int32():
    make_config(with_buffer("swa", "k", bytes_per_token=(2**31 - 1) // 64 // 8 * 8))
    too_big = with_buffer("swa", "k", bytes_per_token=2**25)  # 64 tokens x 32 MiB = 2 GiB
    assert_expected_inline(
        error(too_big),
        """layer 'swa', buffer 'k': CFG-1: a page (64 tokens x 33554432 bytes) must be smaller than 2 GiB (int32 byte offsets)""",
    )


def test_cfg1_bad_window():
    assert_expected_inline(
        error(lambda: with_layer("swa", window=0)),
        """layer 'swa': CFG-1: window must be a positive int or None, got 0""",
    )
    assert_expected_inline(
        error(lambda: with_layer("swa", window=-128)),
        """layer 'swa': CFG-1: window must be a positive int or None, got -128""",
    )


def test_cfg1_layer_without_buffers():
    assert_expected_inline(
        error(lambda: with_layer("swa", buffers=[])),
        """layer 'swa': CFG-1: a layer needs at least one buffer""",
    )


def test_cfg1_bad_device_string():
    assert_expected_inline(
        error(device="cuda:x"),
        """config: CFG-1: device 'cuda:x' is not a torch device""",
    )
    # torch's own reason is embedded, so only the stable prefix is pinned for these
    for device in ("gpu", None):
        prefix = f"config: CFG-1: device {device!r} is not a torch device"
        with pytest.raises(ValueError, match="^" + re.escape(prefix)):
            make_config(device=device)


def test_cfg1_bad_max_total_input_tokens():
    assert_expected_inline(
        error(max_total_input_tokens=0),
        """config: CFG-1: max_total_input_tokens must be a positive int or None, got 0""",
    )
    assert_expected_inline(
        error(max_total_input_tokens=2.5),
        """config: CFG-1: max_total_input_tokens must be a positive int or None, got 2.5""",
    )


# ---------------------------------------------------------------- CFG-2


def test_cfg2_non_positive_chunks():
    assert_expected_inline(
        error(lambda: with_buffer("swa", "v", chunks=0)),
        """buffer 'v': CFG-2: chunks must be a positive int, got 0""",
    )
    assert_expected_inline(
        error(lambda: with_buffer("swa", "v", chunks=-8)),
        """buffer 'v': CFG-2: chunks must be a positive int, got -8""",
    )


def test_cfg2_bytes_per_token_must_divide_by_chunks():
    make_config(with_buffer("L0", "latent", chunks=656))  # 1 byte per chunk-token
    assert make_config().layer("swa").buffers[0].bytes_per_chunk_token == 256
    assert_expected_inline(
        error(lambda: with_buffer("L0", "latent", chunks=3)),
        """buffer 'latent': CFG-2: bytes_per_token (656) must be divisible by chunks (3)""",
    )


# ---------------------------------------------------------------- CFG-3


def test_cfg3_tokens_per_unit_non_positive():
    assert_expected_inline(
        error(lambda: with_sparse("P", tokens_per_unit=0)),
        """sparse settings: CFG-3: tokens_per_unit must be a positive int, got 0""",
    )


def test_cfg3_width_non_positive():
    assert_expected_inline(
        error(lambda: with_sparse("P", width=0)),
        """sparse settings: CFG-3: width must be a positive int, got 0""",
    )


def test_cfg3_slots_non_positive():
    assert_expected_inline(
        error(lambda: with_sparse("P", slots=-4)),
        """sparse settings: CFG-3: slots must be a positive int, got -4""",
    )


def test_cfg3_max_inflight_tokens_non_positive():
    assert_expected_inline(
        error(lambda: with_sparse("P", max_inflight_tokens=0)),
        """sparse settings: CFG-3: max_inflight_tokens must be a positive int, got 0""",
    )


def test_cfg3_tokens_per_unit_must_divide_tokens_per_page():
    assert_expected_inline(
        error(lambda: with_sparse("P", tokens_per_unit=48)),
        """layer 'P', buffer 'latent': CFG-3: tokens_per_unit (48) must divide tokens_per_page (64)""",
    )
    # a unit may be a whole page but not more
    assert_expected_inline(
        error(lambda: with_sparse("P", tokens_per_unit=128)),
        """layer 'P', buffer 'latent': CFG-3: tokens_per_unit (128) must divide tokens_per_page (64)""",
    )


def test_cfg3_slots_multiple_of_units_per_page():
    assert_expected_inline(
        error(lambda: with_sparse("P", slots=70)),
        """layer 'P', buffer 'latent': CFG-3: slots (70) must be a multiple of units per page (4)""",
    )


def test_cfg3_slots_cover_width_and_inflight_units_boundary():
    # E = 1 so every slot count is a multiple: S >= K + ceil(I / U) + 1 = 8 + 2 + 1
    sparse = SparseSpec(tokens_per_unit=64, width=8, slots=11, max_inflight_tokens=128)
    make_config(one_layer(sparse))
    assert_expected_inline(
        error(lambda: one_layer(dataclasses.replace(sparse, slots=10))),
        """layer 'only', buffer 'latent': CFG-3: slots (10) must be >= width + ceil(max_inflight_tokens / tokens_per_unit) + 1 = 11""",
    )
    # the ceiling, not the floor: 129 in-flight tokens may touch 3 whole units, plus the head
    assert_expected_inline(
        error(lambda: one_layer(dataclasses.replace(sparse, max_inflight_tokens=129))),
        """layer 'only', buffer 'latent': CFG-3: slots (11) must be >= width + ceil(max_inflight_tokens / tokens_per_unit) + 1 = 12""",
    )
    make_config(one_layer(dataclasses.replace(sparse, max_inflight_tokens=129, slots=12)))


def test_cfg3_slots_boundary_with_several_units_per_page():
    # E = 4: 61 + ceil(32 / 16) + 1 = 64 is accepted, the next multiple down is not
    sparse = dataclasses.replace(PRIVATE, width=61, slots=64)
    make_config(one_layer(sparse))
    assert_expected_inline(
        error(lambda: one_layer(dataclasses.replace(sparse, width=62))),
        """layer 'only', buffer 'latent': CFG-3: slots (64) must be >= width + ceil(max_inflight_tokens / tokens_per_unit) + 1 = 65""",
    )


def test_cfg3_entries_fit_int32():
    # max_rows * slots entries: 32768 * 65535 fits, 32769 * 65535 does not
    sparse = SparseSpec(tokens_per_unit=64, width=65533, slots=65535, max_inflight_tokens=1)
    make_config(one_layer(sparse), max_rows=32768)
    assert_expected_inline(
        error(lambda: one_layer(sparse), max_rows=32769),
        """layer 'only', buffer 'latent': CFG-3: max_rows * slots (32769 * 65535) must fit int32 (entries are int32)""",
    )


def test_cfg3_slots_upper_limit():
    sparse = SparseSpec(tokens_per_unit=64, width=65534, slots=65536, max_inflight_tokens=1)
    assert_expected_inline(
        error(lambda: one_layer(sparse)),
        """layer 'only', buffer 'latent': CFG-3: slots (65536) must be at most 65535""",
    )


# ---------------------------------------------------------------- CFG-4


def test_cfg4_shared_id_disagrees_on_tokens_per_unit():
    assert_expected_inline(
        error(lambda: with_sparse("L1", tokens_per_unit=2)),
        """layer 'L1', buffer 'latent': CFG-4: tokens_per_unit (2) differs from layer 'L0' (1) in selection group 'dsa'""",
    )


def test_cfg4_shared_id_disagrees_on_width():
    assert_expected_inline(
        error(lambda: with_sparse("L2", width=1024)),
        """layer 'L2', buffer 'latent': CFG-4: width (1024) differs from layer 'L0' (2048) in selection group 'dsa'""",
    )


def test_cfg4_shared_id_disagrees_on_slots():
    assert_expected_inline(
        error(lambda: with_sparse("L1", slots=2240)),
        """layer 'L1', buffer 'latent': CFG-4: slots (2240) differs from layer 'L0' (2176) in selection group 'dsa'""",
    )


def test_cfg4_shared_id_disagrees_on_max_inflight_tokens():
    assert_expected_inline(
        error(lambda: with_sparse("L1", max_inflight_tokens=32)),
        """layer 'L1', buffer 'latent': CFG-4: max_inflight_tokens (32) differs from layer 'L0' (64) in selection group 'dsa'""",
    )


def test_cfg4_shared_id_disagrees_on_window():
    assert_expected_inline(
        error(lambda: with_layer("L2", window=4096)),
        """layer 'L2', buffer 'latent': CFG-4: window (4096) differs from layer 'L0' (None) in selection group 'dsa'""",
    )


def test_cfg4_selection_id_must_be_a_string():
    assert_expected_inline(
        error(lambda: with_sparse("P", selection_id=7)),
        """sparse settings: CFG-4: selection_id must be a non-empty str or None, got 7""",
    )


# ---------------------------------------------------------------- CFG-5


def test_cfg5_sparse_buffers_without_sparse_settings():
    assert_expected_inline(
        error(lambda: with_layer("L1", sparse=None)),
        """layer 'L1', buffer 'latent': CFG-5: a layer with sparse buffers needs sparse settings""",
    )


def test_cfg5_sparse_settings_without_sparse_buffers():
    assert_expected_inline(
        error(lambda: with_layer("swa", sparse=PRIVATE)),
        """layer 'swa': CFG-5: a layer without sparse buffers must not have sparse settings""",
    )


def test_cfg5_mixed_layer_sparsity_is_per_buffer():
    layer = make_config().layer("L0")
    assert [b.sparse for b in layer.buffers] == [False, True]
    assert layer.sparse_buffers == (LATENT,)


# ---------------------------------------------------------------- CFG-6


def test_cfg6_zero_size_buffers_are_accepted():
    config = make_config()
    assert config.layer("P").buffers[1] == BufferSpec("sink", 0)
    # a sparse zero-size buffer, even alone in its layer, and with several chunks
    zero = BufferSpec("latent", 0, sparse=True, chunks=4)
    config = make_config(one_layer(PRIVATE, buffers=[zero]))
    assert config.layer("only").sparse_buffers == (zero,)
    assert config.group_of("only").layers == ("only",)
    assert zero.bytes_per_chunk_token == 0


# ---------------------------------------------------------------- CFG-7


def test_cfg7_bools_are_not_ints():
    assert_expected_inline(
        error(max_rows=True),
        """config: CFG-1: max_rows must be a positive int, got True""",
    )
    assert_expected_inline(
        error(lambda: with_buffer("L0", "latent", bytes_per_token=True)),
        """buffer 'latent': CFG-1: bytes_per_token must be a non-negative int, got True""",
    )
    assert_expected_inline(
        error(lambda: with_sparse("L0", width=True)),
        """sparse settings of selection_id 'dsa': CFG-3: width must be a positive int, got True""",
    )


# Every rule's violation is a ValueError (never TypeError, AttributeError, ZeroDivisionError)
# whose message starts with where it is and which rule it breaks.
VIOLATIONS = {
    "tokens_per_page=True": (dict(tokens_per_page=True), "config: CFG-1: "),
    "tokens_per_page=64.0": (dict(tokens_per_page=64.0), "config: CFG-1: "),
    "max_tokens_per_row='1'": (dict(max_tokens_per_row="1"), "config: CFG-1: "),
    "gpu_budget_bytes=1.0": (dict(gpu_budget_bytes=1.0), "config: CFG-1: "),
    "host_budget_bytes=None": (dict(host_budget_bytes=None), "config: CFG-1: "),
    "max_total_input_tokens=True": (dict(max_total_input_tokens=True), "config: CFG-1: "),
    "window=True": (dict(layers=lambda: with_layer("swa", window=True)), "layer 'swa': CFG-1: "),
    "window=1.5": (dict(layers=lambda: with_layer("swa", window=1.5)), "layer 'swa': CFG-1: "),
    "bytes_per_token=1.5": (dict(layers=lambda: with_buffer("swa", "k", bytes_per_token=1.5)),
                            "buffer 'k': CFG-1: "),
    "chunks=True": (dict(layers=lambda: with_buffer("swa", "k", chunks=True)),
                    "buffer 'k': CFG-2: "),
    "chunks=2.0": (dict(layers=lambda: with_buffer("swa", "k", chunks=2.0)), "buffer 'k': CFG-2: "),
    "tokens_per_unit=True": (dict(layers=lambda: with_sparse("P", tokens_per_unit=True)),
                             "sparse settings: CFG-3: "),
    "tokens_per_unit=0 (no division by zero)": (
        dict(layers=lambda: with_sparse("L1", tokens_per_unit=0)),
        "sparse settings of selection_id 'dsa': CFG-3: "),
    "slots=68.0": (dict(layers=lambda: with_sparse("P", slots=68.0)), "sparse settings: CFG-3: "),
    "max_inflight_tokens=None": (dict(layers=lambda: with_sparse("P", max_inflight_tokens=None)),
                                 "sparse settings: CFG-3: "),
    "role=''": (dict(layers=lambda: [LayerSpec("x", [BufferSpec("", 4)])]), "buffer: CFG-1: "),
    "sparse=1": (dict(layers=lambda: with_buffer("swa", "k", sparse=1)), "buffer 'k': CFG-1: "),
    "name=''": (dict(layers=lambda: [LayerSpec("", [INDEXER_K])]), "layer: CFG-1: "),
    "name=3": (dict(layers=lambda: [LayerSpec(3, [INDEXER_K])]), "layer: CFG-1: "),
    "buffers=BufferSpec": (dict(layers=lambda: with_layer("swa", buffers=INDEXER_K)),
                           "layer 'swa': CFG-1: "),
    "sparse=<a BufferSpec>": (dict(layers=lambda: with_layer("L0", sparse=LATENT)),
                              "layer 'L0': CFG-3: "),
    "max_query_tokens=0": (dict(layers=lambda: with_sparse("P", max_query_tokens=0)),
                           "sparse settings: MTP-1: "),
    "selection_id=''": (dict(layers=lambda: with_sparse("P", selection_id="")),
                        "sparse settings: CFG-4: "),
    "device='meta'": (dict(device="meta"), "config: CFG-1: "),
}


@pytest.mark.parametrize("changes, prefix", VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_cfg7_every_violation_is_a_value_error_naming_where_and_rule(changes, prefix):
    assert error(**changes).startswith(prefix)


def test_cfg7_a_layer_that_is_not_a_layer_spec_is_a_value_error():
    assert error([INDEXER_K]).startswith("config: CFG-1: layers must be LayerSpec")
