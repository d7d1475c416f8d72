"""A small decoder in plain PyTorch that computes what SGLang's ``GraniteForCausalLM`` computes, so a model
trained here is served by SGLang unchanged (config + safetensors in Hugging Face format).

Shape follows the product's target: ``heads_per_kv`` (16) query heads per KV head, head_dim 128, RoPE
(neox style, as SGLang's Granite uses), RMSNorm, SiLU-gated MLP, untied LM head. Parameter names equal
the Hugging Face names, so ``state_dict()`` is the checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import format as fmt
from ..tiny_model import granite_config
from . import task


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = 256
    layers: int = 2
    kv_heads: int = 1
    heads_per_kv: int = 16
    head_dim: int = fmt.HEAD_DIM
    intermediate_size: int = 512
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    vocab_size: int = task.VOCAB_SIZE

    @property
    def heads(self) -> int:
        return self.kv_heads * self.heads_per_kv

    def hf_config(self) -> dict:
        """``config.json`` for SGLang / transformers (GraniteForCausalLM, as :func:`~sglang_nvfp4.tiny_model.granite_config`)."""
        return granite_config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                              intermediate_size=self.intermediate_size, layers=self.layers, heads=self.heads,
                              kv_heads=self.kv_heads, head_dim=self.head_dim,
                              context_len=self.max_position_embeddings, rope_theta=self.rope_theta,
                              rms_norm_eps=self.rms_norm_eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[L, head_dim]`` (neox layout: the two halves share frequencies)."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=positions.device).float() / cfg.head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, L, D]``; rotate-half (neox) rotary embedding, computed in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[B, H, L, D]``, ``k``/``v`` ``[B, Hkv, L, D]`` -> ``[B, H, L, D]``; causal, GQA."""
    group = q.shape[1] // k.shape[1]
    # Expanding K/V (instead of ``enable_gqa``) keeps every SDPA backend, flash included, eligible.
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        b, n, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, n, c.heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
        out = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, c.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, c.heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class RetrievalLM(nn.Module):
    """``forward(tokens [B, L] int64) -> logits [B, L, vocab]``. ``attention`` replaces the dense causal
    attention (same signature as :func:`dense_causal_attention`), e.g. to run the model over a sparse or
    quantized attention without SGLang."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, attention=dense_causal_attention) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(self.cfg, positions)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.lm_head(self.model.norm(x))


def save_hf(model: RetrievalLM, out_dir: str, extra: dict | None = None) -> str:
    """Write ``config.json``, ``model.safetensors`` (bf16), the tokenizer and ``training.json`` (``extra``)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.cfg.hf_config(), f, indent=1)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    task.write_tokenizer(out_dir)
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump({"model_config": asdict(model.cfg), **(extra or {})}, f, indent=1)
    return out_dir


def load_hf(model_dir: str, device="cpu", dtype=torch.float32) -> RetrievalLM:
    """Inverse of :func:`save_hf`."""
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "training.json")) as f:
        cfg = ModelConfig(**json.load(f)["model_config"])
    model = RetrievalLM(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()})
    return model.to(device).eval()
