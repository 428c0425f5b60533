import subprocess
import sys

import pytest

from hicache_client.keys import key_str, namespace_seed, page_keys, request_seed

NS = dict(model_fingerprint="m", dtype="bfloat16", page_size=4, layout="layer_first")


def test_page_keys_chain_and_partial_page():
    seed = namespace_seed(**NS)
    keys = page_keys(list(range(10)), 4, seed)
    assert len(keys) == 2  # the trailing partial page has no key
    # Chaining: page 2's key depends on page 1.
    assert page_keys(list(range(4, 8)), 4, keys[0]) == [keys[1]]
    assert page_keys([99, 1, 2, 3, 4, 5, 6, 7], 4, seed)[1] != keys[1]


def test_namespace_fields_all_matter():
    base = namespace_seed(**NS)
    assert namespace_seed(**NS) == base
    for field, other in [("model_fingerprint", "m2"), ("dtype", "float16"), ("page_size", 8),
                         ("layout", "page_first")]:
        assert namespace_seed(**{**NS, field: other}) != base
    assert namespace_seed(**NS, tp_rank=1, tp_size=2) != base
    assert namespace_seed(**NS, extra="salt") != base


def test_extra_key_salts_chain():
    seed = namespace_seed(**NS)
    assert request_seed(seed, None) == seed == request_seed(seed, "")
    assert request_seed(seed, "tenant-a") != request_seed(seed, "tenant-b")


def test_keys_identical_in_fresh_process():
    code = (
        "from hicache_client.keys import namespace_seed, page_keys, key_str\n"
        "s = namespace_seed(model_fingerprint='m', dtype='bfloat16', page_size=4, "
        "layout='layer_first')\n"
        "print(','.join(key_str(k) for k in page_keys(list(range(12)), 4, s)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    here = ",".join(key_str(k) for k in page_keys(list(range(12)), 4, namespace_seed(**NS)))
    assert out == here


def test_token_range_checked():
    with pytest.raises(ValueError):
        page_keys([-1, 0], 2, b"\0" * 32)
    with pytest.raises(ValueError):
        page_keys([2**32, 0], 2, b"\0" * 32)
