"""The raw reference row computes on the server's KV cache type: a q8_0 server's raw row is timed
on a q8_0 cache, not on f16 (found in issue 50: it always made f16)."""
from __future__ import annotations

import pytest

from appliance.bench.raw import RawSettings, _Llama
from appliance.compute_settings import LlamaCppSettings
from appliance.engine.grid import Grid

from ..engine.gguf_fixtures import write_tiny_llama

HEALTH = {"n_ctx": 256, "n_slots": 1, "settings": {"n_threads": 2, "n_threads_batch": 2, "n_batch": 512,
                                                   "n_ubatch": 512, "flash_attn": True, "kv_type": "q8_0"}}


def test_the_raw_settings_carry_the_servers_kv_type():
    assert RawSettings.from_health(HEALTH, 512).kv_type == "q8_0"
    older = {**HEALTH, "settings": {k: v for k, v in HEALTH["settings"].items() if k != "kv_type"}}
    assert RawSettings.from_health(older, 512).kv_type == "f16"     # a server from before: f16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # heads of 32: q8_0 blocks fit
    return str(write_tiny_llama(tmp_path_factory.mktemp("raw") / "tiny.gguf", n_head=2, n_head_kv=1))


def state_bytes(path: str, kv_type: str) -> tuple[int, list[int]]:
    """One 100-token prefill in the raw worker's llama.cpp context (in this process): the
    sequence's saved state size (its KV cells at the context's type) and 8 greedy tokens."""
    st = RawSettings(256, 1, LlamaCppSettings(n_threads=2, n_threads_batch=2, n_batch=512, n_ubatch=512,
                                              flash_attn=True), Grid(64, 0), kv_type=kv_type)
    llama = _Llama(path, st)
    try:
        ttft, _, _, tokens = llama.run([list(range(10, 110))], 8)
        return llama.L.llama_state_seq_get_size(llama.ctx, 0), tokens[0]
    finally:
        llama.L.llama_batch_free(llama.batch)
        llama.L.llama_free(llama.ctx)
        llama.L.llama_model_free(llama.model)


def test_the_raw_worker_computes_on_that_kv_type(tiny):
    f16, f16_tokens = state_bytes(tiny, "f16")
    q8, q8_tokens = state_bytes(tiny, "q8_0")
    # 100 cells of K and V: q8_0 stores 34 bytes per 32 values where f16 stores 64
    assert q8 < 0.6 * f16, (q8, f16)
    assert len(q8_tokens) == len(f16_tokens) == 8
