"""MiniMax-M3 configuration under nvfp4_sparse (no server): what the backend serves of a checkpoint's
``sparse_attention_config``, the start-up refusals, the sizing of the pool with the index keys, and the
plugin's two M3 hooks (pool builder, backend wrapper)."""

from types import SimpleNamespace

import math
import pytest
import torch

pytest.importorskip("sglang.srt")

from transformers import PretrainedConfig  # noqa: E402

from sglang_nvfp4.indexer import LearnedIndexer, ProxyIndexer, StateBytes  # noqa: E402
from sglang_nvfp4.sglang import plugin  # noqa: E402
from sglang_nvfp4.sglang.config import load_config, startup_config  # noqa: E402
from sglang_nvfp4.sglang.minimax_m3 import M3Sparsity, m3_sparsity  # noqa: E402
from sglang_nvfp4.tiny_model import minimax_m3_config  # noqa: E402


def m3_config(layers=4, sparse_layers=(1, 2, 3), **sparse_changes):
    cfg = minimax_m3_config(vocab_size=512, hidden_size=256, layers=layers, heads=64, kv_heads=4, context_len=8192,
                            sparse_layers=list(sparse_layers))
    cfg["sparse_attention_config"].update(sparse_changes)
    return PretrainedConfig(**cfg)


@pytest.fixture(autouse=True)
def fresh_startup_config():
    startup_config.cache_clear()
    yield
    startup_config.cache_clear()


def test_m3_sparsity_from_the_checkpoint_config():
    m3 = m3_sparsity(m3_config(sparse_init_block=2, sparse_local_block=3, sparse_topk_blocks=12))
    assert m3 == M3Sparsity(frozenset({1, 2, 3}), 12, 2, 3, torch.bfloat16)
    # a pipeline stage holding layers 2..3: local ids; M3's local count includes the own block, ours does not
    options = {"topk": 12, "sink_blocks": 2, "local_blocks": 2, "key_dtype": torch.bfloat16}
    assert m3.indexer_kind(2, 2) == (LearnedIndexer, {"sparse_layers": (0, 1), **options})
    # layers forced dense (NVFP4_SPARSE_DENSE_LAYERS) keep no index keys; "all" (None) leaves none sparse
    assert m3.indexer_kind(0, 4, frozenset({2}))[1]["sparse_layers"] == (1, 3)
    assert m3.indexer_kind(0, 4, None)[1]["sparse_layers"] == ()
    fp16 = m3_config()
    fp16.torch_dtype = torch.float16
    assert m3_sparsity(fp16).key_dtype == torch.float16
    tokens = m3_sparsity(m3_config(sparse_init_block=None, sparse_local_block=None, sparse_init_tokens=200,
                                   sparse_local_tokens=100))
    assert (tokens.init_blocks, tokens.local_blocks) == (2, 2)  # SGLang's ceil(tokens / 128) (+1 for local)
    assert m3_sparsity(PretrainedConfig(architectures=["LlamaForCausalLM"])) is None


@pytest.mark.parametrize("change, message", [
    ({"sparse_disable_index_value": [1, 0, 1, 1]}, r"index value heads \(sparse_disable_index_value 0\) on layers \[1\]"),
    ({"sparse_score_type": "lse"}, "sparse_score_type='lse' is not supported"),
    ({"sparse_topk_blocks": 32}, "sparse_topk_blocks=32 is not supported"),
    ({"sparse_block_size": 64}, "sparse_block_size=64 is not supported"),
    ({"sparse_index_dim": 64}, "sparse_index_dim=64 is not supported"),
    ({"sparse_num_index_heads": 8}, "sparse_num_index_heads=8 is not supported .*one index head per KV head"),
    ({"sparse_init_block": 10, "sparse_local_block": 7}, "do not fit sparse_topk_blocks=16"),
    ({"sparse_attention_freq": [1, 1]}, "sparse_attention_freq has 2 entries for 4 layers"),
    ({"sparse_attention_freq": None}, "sparse_attention_freq has 0 entries for 4 layers"),
    ({"sparse_disable_index_value": [1, 1]}, r"index value heads .* on layers \[2, 3\]"),
])
def test_unsupported_m3_variants_are_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        m3_sparsity(m3_config(**change))


def test_selection_variables_are_refused_for_m3_and_dense_layers_apply():
    with pytest.raises(ValueError, match="NVFP4_SPARSE_INDEXER, NVFP4_SPARSE_TOPK: MiniMax-M3 selects"):
        load_config({"NVFP4_SPARSE_TOPK": "8", "NVFP4_SPARSE_INDEXER": "mean"}).for_model(m3_config())
    config = load_config({"NVFP4_SPARSE_DENSE_LAYERS": "3"}).for_model(m3_config())
    assert [config.is_dense_layer(i) for i in range(4)] == [True, False, False, True]  # model's layer 0, env's 3
    assert load_config({"NVFP4_SPARSE_TOPK": "8"}).for_model(PretrainedConfig(architectures=["X"])).model is None


def test_pool_bytes_count_the_index_keys_of_the_ranks_sparse_layers(monkeypatch):
    from sglang.srt import runtime_context

    monkeypatch.setattr(plugin, "backend_active", lambda: True)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: SimpleNamespace(attn_tp_size=2, attn_dcp_size=1))
    hf = m3_config()
    kvc = SimpleNamespace(model_config=SimpleNamespace(get_num_kv_heads=lambda tp, dcp: 4 // tp, hf_config=hf),
                          layer_info=SimpleNamespace(start_layer=0))
    # 4 layers x 2 KV heads (TP 2) x 144 B of NVFP4 K/V + 3 sparse layers x 128 bf16 index-key dims + SGLang's
    # 48 B, less the share of those 48 B a stock pool leaves outside (d = 4 x 2 x 512 bf16 K/V + 3 x 256 index keys)
    buffers, stock = 48 + 8 / 128, 4 * 2 * 512 + 3 * 256
    assert plugin.cell_size_override(kvc, 4, stock) == math.ceil((4 * 2 * 144 + 3 * 256 + buffers) * stock
                                                                  / (stock + buffers))
    kvc.layer_info.start_layer = 2  # a pipeline stage with layers 2..3, both sparse
    stock = 2 * 2 * 512 + 2 * 256
    assert plugin.cell_size_override(kvc, 2, stock) == math.ceil((2 * 2 * 144 + 2 * 256 + buffers) * stock
                                                                 / (stock + buffers))
    config = load_config({}).for_model(hf)
    assert config.indexer_state_bytes(4, 2) == StateBytes(per_token=3 * 256)
    assert load_config({}).indexer_kind(0, 4)[0] is ProxyIndexer
    assert load_config({"NVFP4_SPARSE_DENSE_LAYERS": "1"}).for_model(hf).indexer_state_bytes(4, 2) == \
        StateBytes(per_token=2 * 256)
    ix = config.build_indexer(4, 3, 2, "cpu")
    assert isinstance(ix, LearnedIndexer) and sorted(ix.index_keys) == [1, 2, 3]
    assert ix.state_nbytes() == 3 * 3 * 128 * 128 * 2
    # fp8 index keys: 128 E4M3 codes and one exponent byte per token and sparse layer
    fp8 = load_config({"NVFP4_SPARSE_INDEX_KEYS": "fp8"}).for_model(hf)
    assert fp8.model.key_dtype == torch.float8_e4m3fn
    assert fp8.indexer_state_bytes(4, 2) == StateBytes(per_token=3 * 129)
    monkeypatch.setenv("NVFP4_SPARSE_INDEX_KEYS", "fp8")
    startup_config.cache_clear()
    kvc.layer_info.start_layer = 0
    stock = 4 * 2 * 512 + 3 * 256  # SGLang's own M3 pool keeps bf16 index keys whatever this backend does
    assert plugin.cell_size_override(kvc, 4, stock) == math.ceil((4 * 2 * 144 + 3 * 129 + buffers) * stock
                                                                  / (stock + buffers))
    ix = fp8.build_indexer(4, 3, 2, "cpu")
    assert ix.state_nbytes() == 3 * 3 * 128 * 129 and ix.index_keys[1].keys.dtype == torch.float8_e4m3fn


def test_index_key_storage_is_validated_at_start_up():
    with pytest.raises(ValueError, match="NVFP4_SPARSE_INDEX_KEYS='fp4': expected one of \\('model', 'fp8'\\)"):
        load_config({"NVFP4_SPARSE_INDEX_KEYS": "fp4"})
    with pytest.raises(ValueError, match="NVFP4_SPARSE_INDEX_KEYS=fp8: only MiniMax-M3 checkpoints keep index keys"):
        load_config({"NVFP4_SPARSE_INDEX_KEYS": "fp8"}).for_model(PretrainedConfig(architectures=["X"]))
    assert load_config({"NVFP4_SPARSE_INDEX_KEYS": "model"}).for_model(m3_config()).model.key_dtype == torch.bfloat16


def test_m3_hooks_swap_in_the_nvfp4_pool_and_leave_the_backend_unwrapped(monkeypatch):
    from sglang_nvfp4.sglang.backend import NVFP4SparseAttnBackend
    from sglang_nvfp4.sglang.kv_pool import NVFP4TokenToKVPool

    calls = []
    configurator = SimpleNamespace(_build_mha_kv_pool=lambda **kw: calls.append(kw) or "nvfp4 pool")
    original_pool = lambda conf, max_total_num_tokens: "MiniMaxSparseKVPool"  # noqa: E731
    monkeypatch.setattr(plugin, "backend_active", lambda: True)
    assert plugin._minimax_m3_pool(original_pool, configurator, max_total_num_tokens=1024) == "nvfp4 pool"
    assert calls == [{"max_total_num_tokens": 1024, "mha_pool_class": NVFP4TokenToKVPool}]
    ours = NVFP4SparseAttnBackend.__new__(NVFP4SparseAttnBackend)
    original_wrapper = lambda runner, full: ("MiniMaxHybridAttnBackend", full)  # noqa: E731
    assert plugin._attn_backend_wrapper(original_wrapper, None, ours) is ours
    assert plugin._attn_backend_wrapper(original_wrapper, None, "triton") == ("MiniMaxHybridAttnBackend", "triton")
    monkeypatch.setattr(plugin, "backend_active", lambda: False)
    assert plugin._minimax_m3_pool(original_pool, configurator, max_total_num_tokens=1024) == "MiniMaxSparseKVPool"
