"""benchmarks/v4_capacity.py: DeepSeek-V4's KV per request with the CSA history in HBM or on
host pages behind cells, by hand-checked arithmetic on the model's own config (transformers'
DeepseekV4Config defaults: DeepSeek-V4-Flash-Base)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
v4 = pytest.importorskip("v4_capacity")


def test_the_shape_is_the_models():
    pytest.importorskip("transformers")
    try:
        shape = v4.v4_shape()
    except ImportError:
        pytest.skip("this transformers has no DeepseekV4Config (5.23 has it)")
    assert (shape["layers"], shape["csa"], shape["hca"]) == (43, 20, 23)
    assert (shape["csa_rate"], shape["hca_rate"], shape["window"]) == (4, 128, 128)
    assert (shape["head_dim"], shape["index_head_dim"], shape["index_topk"]) == (512, 128, 512)


def test_per_request_bytes_by_hand():
    """1M tokens: 262,144 CSA entries x 584 B x 20 layers on host; on the GPU the indexer's
    keys (x 132 B x 20), 8,192 HCA entries x 584 B x 23, the windows (128 x 584 B x 43), the
    states, and 1,024 cells x 584 B per CSA layer."""
    shape = dict(layers=43, csa=20, hca=23, window=128, head_dim=512, index_head_dim=128,
                 index_topk=512, csa_rate=4, hca_rate=128)
    r = v4.per_request(shape, 1 << 20, hot=1024)
    states = (20 * ((3 * 2 * 1024 * 2 + 4 * 2 * 512 * 2) + (3 * 2 * 256 * 2 + 4 * 2 * 128 * 2))
              + 23 * 127 * 2 * 512 * 2)
    common = 128 * 584 * 43 + states + 262144 * 132 * 20 + 8192 * 584 * 23
    assert r["parts"]["states"] == states
    assert r["host"] == 262144 * 584 * 20
    assert r["hbm"] == common + 262144 * 584 * 20
    assert r["gpu"] == common + 1024 * 584 * 20
    rows = v4.table(shape, [1 << 17, 1 << 20], kv_gb=100, hot=1024)
    assert [row["gpu_requests"] > 4 * row["hbm_requests"] for row in rows] == [True, True]
