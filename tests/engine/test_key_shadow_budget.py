"""The key shadow stays inside its budget (``engine_ext/attention/key_shadow/pool.py``): the worker
reserves at least what one request needs (its table of shadow pages and one layer's scratch
copy), and the cap is what the budget holds after the scratch reserve -- never more. A real vLLM
config for tiny-llama (no engine started)."""

from __future__ import annotations

import random

import pytest

from minipic.engine_ext.attention.key_shadow import pool as key_shadow_pool
from minipic.span_contract.errors import EngineIntegrationError

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.engine.arg_utils import EngineArgs

    from minipic.span_contract.engine_config import EngineSettings

    kwargs = EngineSettings(model="tiny-llama").resolved().llm_kwargs()
    kwargs.pop("disable_log_stats", None)
    return EngineArgs(**kwargs).create_engine_config()


def test_cap_never_exceeds_the_budget(vllm_config, seed, monkeypatch) -> None:
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    block = vllm_config.cache_config.block_size
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    page = block * model.get_num_kv_heads(parallel) * model.get_head_size() * 4  # float32
    entry, longest = page * layers, -(-model.max_model_len // block)
    scratch = 2 * longest * page
    need = key_shadow_pool.one_request_bytes(vllm_config)
    assert need == longest * entry + scratch
    monkeypatch.setitem(key_shadow_pool._BUDGET, "pool_bytes", need)
    assert key_shadow_pool.pool_cap_entries(entry, longest, scratch) == longest
    rng = random.Random(seed)
    for _ in range(200):
        budget = rng.randrange(need, 50 * need)
        monkeypatch.setitem(key_shadow_pool._BUDGET, "pool_bytes", budget)
        cap = key_shadow_pool.pool_cap_entries(entry, longest, scratch)
        assert longest <= cap and cap * entry + scratch <= budget, (seed, budget, cap)
    # a budget below one request: a clear error, never a cap past the budget
    monkeypatch.setitem(key_shadow_pool._BUDGET, "pool_bytes", need - 1)
    with pytest.raises(EngineIntegrationError, match="max-model-len"):
        key_shadow_pool.pool_cap_entries(entry, longest, scratch)
