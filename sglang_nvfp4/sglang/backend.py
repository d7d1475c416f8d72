"""``nvfp4_sparse``: SGLang attention backend over the NVFP4 KV pool with top-k block sparsity.

The backend owns block selection: at start-up it resolves the configuration once
(:func:`.config.startup_config`) and has the configured :class:`~sglang_nvfp4.indexer.BlockIndexer` built
beside the pool, which tells it about every cache write.

Per forward, :meth:`NVFP4SparseAttnBackend.init_forward_metadata` builds once, from SGLang's
``req_to_token`` table, what every layer shares: a block table per batch request
(``req_to_token[req, ::128] // 128``: the page of each 128-token block), for each query token its
batch row and position (radix prefix and chunked-prefill offsets included; starts need not be page
aligned), the selection of dense layers when any are configured, and the kernel plan
(:func:`sglang_nvfp4.kernels.plan_attention`). It is rebuilt on every forward because the radix cache
may move a request's pages. Per layer, ``forward_*`` writes the new K/V into the pool, asks the
indexer for the block ids of each token and KV head (dense layers take the forward's all-visible
selection) and runs the plan; the keyword arguments of the model's attention call (e.g. MiniMax-M3's
``idx_q``/``idx_k``) go to the indexer with the write and the selection. A call that carries ``idx_q``
(MiniMax-M3's sparse layers, :mod:`.minimax_m3`) gets ``(idx_o, output)`` back, ``idx_o = None``: the
index value heads that would fill it are refused at start-up. Decode CUDA graphs refresh
static copies of the same metadata in place (padded rows: request row 0, position 0); their metadata
object and plan are made once per captured batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

from .. import format as fmt
from .. import kernels
from ..indexer import all_visible_blocks
from . import BACKEND_NAME
from .config import startup_config
from .kv_pool import NVFP4TokenToKVPool, layer_scales


@dataclass
class SparseForwardMetadata:
    block_table: torch.Tensor  # int32 [B, S]: page of block s of batch request b
    req: torch.Tensor  # int32 [T]: batch row of each query token
    pos: torch.Tensor  # int32 [T]: position of each query token in its request
    plan: kernels.AttentionPlan  # the kernels for this forward, over the metadata above
    dense_block_ids: torch.Tensor | None  # int32 [1, T, S]: every visible block (dense layers), or None


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // fmt.PAGE_SIZE)


def build_block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``int32 [B, num_blocks]``: the page holding each 128-token block of each batch request."""
    first_slots = req_to_token[req_pool_indices.long(), : num_blocks * fmt.PAGE_SIZE : fmt.PAGE_SIZE]
    return (first_slots // fmt.PAGE_SIZE).to(torch.int32)


def check_model_supported(model_runner) -> None:
    """Start-up validation of what this backend can serve; ``ValueError`` with the reason."""
    cfg = model_runner.model_config
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"{BACKEND_NAME}: encoder-decoder models (cross attention) are not supported")
    if getattr(model_runner, "use_mla_backend", False):
        raise ValueError(f"{BACKEND_NAME}: MLA models are not supported (the cache holds per-head K/V)")
    if cfg.head_dim != fmt.HEAD_DIM or getattr(cfg, "v_head_dim", fmt.HEAD_DIM) != fmt.HEAD_DIM:
        raise ValueError(f"{BACKEND_NAME}: head_dim {cfg.head_dim} is not supported, only {fmt.HEAD_DIM}")
    if getattr(model_runner, "is_hybrid_swa", False) or getattr(model_runner, "sliding_window_size", None):
        raise ValueError(f"{BACKEND_NAME}: sliding-window attention is not supported")
    spec = getattr(model_runner, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        raise ValueError(f"{BACKEND_NAME}: speculative decoding is not supported")
    model = getattr(model_runner, "model", None)
    for layer in model.modules() if model is not None else ():
        if isinstance(layer, RadixAttention):
            check_layer_supported(layer)


def check_layer_supported(layer: RadixAttention) -> None:
    where = f"{BACKEND_NAME}: layer {layer.layer_id}"
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        raise ValueError(f"{where}: only causal decoder self-attention is supported")
    if layer.logit_cap and layer.logit_cap > 0:
        raise ValueError(f"{where}: logit capping is not supported")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise ValueError(f"{where}: sliding-window attention is not supported")
    if layer.qk_head_dim != fmt.HEAD_DIM or layer.v_head_dim != fmt.HEAD_DIM:
        raise ValueError(f"{where}: head_dim {layer.qk_head_dim}/{layer.v_head_dim} is not supported")
    if layer.tp_q_head_num % layer.tp_k_head_num:
        raise ValueError(f"{where}: {layer.tp_q_head_num} query heads per {layer.tp_k_head_num} KV heads")


def _model_output(out: torch.Tensor, model_inputs: dict):
    """What the model's attention call unpacks: ``(idx_o, out)`` for a call with MiniMax-M3's ``idx_q``
    (``idx_o = None``: no index value heads), else ``out``."""
    return (None, out) if model_inputs.get("idx_q") is not None else out


class NVFP4SparseAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        if not isinstance(self.token_to_kv_pool, NVFP4TokenToKVPool):
            raise ValueError(
                f"{BACKEND_NAME}: the KV pool is {type(self.token_to_kv_pool).__name__}, not NVFP4TokenToKVPool; "
                "both --prefill-attention-backend and --decode-attention-backend must be "
                f"{BACKEND_NAME} (they share the NVFP4 cache), and the sglang_nvfp4 plugin must be loaded"
            )
        check_model_supported(model_runner)
        self.config = startup_config()
        hf_config = getattr(model_runner.model_config, "hf_config", None)  # test runners may lack it
        if hf_config is not None:
            self.config = self.config.for_model(hf_config)
        num_layers = getattr(model_runner.model_config, "num_hidden_layers", None)
        if num_layers is not None:
            cfg = model_runner.model_config
            heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
            self.config.check_model(num_layers, cfg.head_dim, heads // kv_heads if heads and kv_heads else None)
        pool = self.token_to_kv_pool
        self.indexer = pool.attach_indexer(
            lambda: self.config.build_indexer(pool.layer_num, pool.num_pages, pool.head_num, pool.device,
                                              pool.start_layer))
        # Per local layer: attends every visible block (NVFP4_SPARSE_DENSE_LAYERS, or a model's dense layer).
        self.dense_layer = [self.config.is_dense_layer(pool.start_layer + i) for i in range(pool.layer_num)]
        self.max_blocks = _blocks(model_runner.model_config.context_len)
        self.forward_metadata: SparseForwardMetadata | None = None
        self._graph_block_table = self._graph_req = self._graph_pos = self._graph_dense_block_ids = None
        self._graph_metadata: dict[int, SparseForwardMetadata] = {}  # per captured batch size

    def _metadata(self, kind: str, block_table, req, pos, dense_out=None) -> SparseForwardMetadata:
        """What every layer of this forward shares: the metadata, the dense selection (written into
        ``dense_out`` when given: CUDA graphs read static buffers), the kernel plan."""
        plan = kernels.plan_attention(kind, block_table, req, pos, num_kv_heads=self.token_to_kv_pool.head_num,
                                      key_tiles=getattr(self.indexer, "wants_key_tiles", False),
                                      selection_run=getattr(self.indexer, "selection_run", 1))
        dense = None
        if any(self.dense_layer):
            dense = all_visible_blocks(pos, block_table.shape[1])
            dense = dense if dense_out is None else dense_out.copy_(dense)
        return SparseForwardMetadata(block_table, req, pos, plan, dense)

    # ---- metadata, once per forward -------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError(f"{BACKEND_NAME}: speculative decoding is not supported")
        req_pool_indices = forward_batch.req_pool_indices
        bs = forward_batch.batch_size
        num_blocks = _blocks(int(forward_batch.seq_lens_cpu[:bs].max()))
        block_table = build_block_table(self.req_to_token_pool.req_to_token, req_pool_indices, num_blocks)
        if mode.is_decode():
            req = torch.arange(bs, dtype=torch.int32, device=self.device)
            pos = (forward_batch.seq_lens[:bs] - 1).to(torch.int32)
        else:  # EXTEND / MIXED: each request's new tokens follow its cached prefix
            num_tokens = sum(forward_batch.extend_seq_lens_cpu)
            rows = torch.arange(bs, device=self.device)
            req = torch.repeat_interleave(rows, forward_batch.extend_seq_lens, output_size=num_tokens)
            token = torch.arange(num_tokens, device=self.device)
            starts = torch.cumsum(forward_batch.extend_seq_lens, 0) - forward_batch.extend_seq_lens
            pos = (forward_batch.extend_prefix_lens[req] + token - starts[req]).to(torch.int32)
            req = req.to(torch.int32)
        self.forward_metadata = self._metadata("decode" if mode.is_decode() else "prefill", block_table, req, pos)

    # ---- decode CUDA graphs -----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self._graph_block_table = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=self.device)
        self._graph_req = torch.arange(max_bs, dtype=torch.int32, device=self.device)
        self._graph_pos = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        if any(self.dense_layer):
            self._graph_dense_block_ids = torch.full((1, max_bs, self.max_blocks), -1, dtype=torch.int32,
                                                     device=self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Refresh the static decode metadata in place before capture / replay. The metadata object (and its
        plan) is made once per batch size: a replay runs the kernels its capture recorded."""
        mode = forward_batch.forward_mode
        if not mode.is_decode_or_idle():
            raise NotImplementedError(f"{BACKEND_NAME}: CUDA graphs are supported for decode only")
        bs = forward_batch.batch_size
        self._graph_block_table[:bs].copy_(
            build_block_table(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices[:bs], self.max_blocks)
        )
        self._graph_pos[:bs].copy_(forward_batch.seq_lens[:bs] - 1)
        md = self._graph_metadata.get(bs)
        if md is None:
            dense_out = None if self._graph_dense_block_ids is None else self._graph_dense_block_ids[:, :bs]
            md = self._metadata("decode", self._graph_block_table[:bs], self._graph_req[:bs], self._graph_pos[:bs],
                                dense_out)
            self._graph_metadata[bs] = md
        elif md.dense_block_ids is not None:
            md.dense_block_ids.copy_(all_visible_blocks(md.pos, md.block_table.shape[1]))
        self.forward_metadata = md

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # ---- per layer ---------------------------------------------------------------------------
    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs):
        # What the model passes beyond q/k/v (e.g. MiniMax-M3's idx_q/idx_k) goes to the indexer.
        model_inputs = {name: value for name, value in kwargs.items() if value is not None}
        if "sinks" in model_inputs:
            raise NotImplementedError(f"{BACKEND_NAME}: attention sinks are not supported")
        pool = self.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            # A decode step writes one token per request, each on a page of its own (padded CUDA-graph rows:
            # slot 0, a reserved page): no two slots share a V byte, so the write takes one launch.
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, model_inputs=model_inputs,
                               one_token_per_byte=forward_batch.forward_mode.is_decode())
        md = self.forward_metadata
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        cache = pool.layer_cache(layer.layer_id)
        local_id = layer.layer_id - pool.start_layer
        if self.dense_layer[local_id]:
            block_ids = md.dense_block_ids.expand(layer.tp_k_head_num, -1, -1)
        else:
            # A long prefill's plan predecodes the layer's pages once, here, for the selection and the attention.
            predecoded = md.plan.predecode(cache, layer.tp_q_head_num, max(self.indexer.topk, fmt.TOPK))
            tiles = {} if predecoded is None or predecoded.key_tiles is None else {"key_tiles": predecoded.key_tiles}
            block_ids = self.indexer.select(local_id, q3, cache, md.block_table, md.req, md.pos, **model_inputs,
                                            **tiles)
            if block_ids.shape[-1] < fmt.TOPK:  # one kernel variant (and decode split count) for every top-k
                block_ids = torch.nn.functional.pad(block_ids, (0, fmt.TOPK - block_ids.shape[-1]), value=-1)
        k_scale, v_scale = layer_scales(layer)
        out = md.plan.run(q3, cache, block_ids, k_scale, v_scale, layer.scaling)
        return _model_output(out.view(-1, layer.tp_q_head_num * layer.v_head_dim), model_inputs)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_idle():  # SGLang's idle output, in the shape the model unpacks
            out = q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
            return _model_output(out, kwargs)
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs)
