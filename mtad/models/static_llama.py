"""A Llama-family causal LM's forward over static key/value buffers, and its compiled form.

Eager decoding runs transformers' forward over a ``DynamicCache``: dozens of small operators a layer, each
dispatched from Python, which on a CPU cost as much as the matrix products of a one-token forward. Here the
model's own modules and weights (projections, norms, activation, rotary embedding) run in one function over
preallocated buffers ``[rows, kv_heads, capacity, head_dim]`` written at the slots a forward fills
(gpt-fast's layout), and ``torch.compile`` fuses everything between the products, with the weights frozen
so inductor prepacks them for its own CPU kernels.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch._dynamo
import torch._inductor.config
from torch.nn import functional as F

from mtad.models.errors import PairError

ENGINES = ("eager", "compiled")


def resolve_engine(engine: str | None) -> str:
    """An explicit engine wins, then the operator's ``MTAD_ENGINE``, else ``eager``."""
    if engine in (None, "auto"):
        engine = os.environ.get("MTAD_ENGINE") or "eager"
    if engine not in ENGINES:
        raise PairError(f"engine must be auto or one of {', '.join(ENGINES)}; got {engine!r}")
    return engine


def supports(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run on the compiled engine, or None when it can (a Llama-family decoder whose
    layers are transformers' Llama layers, as both shipped pairs' targets are)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a Llama-family causal LM with an lm_head"
    attn = layers[0].self_attn
    if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        return f"{type(attn).__name__} is not a Llama attention layer"
    if getattr(model.config, "sliding_window", None):
        return "sliding-window attention is not supported by the compiled engine"
    return None


def llama_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    keep: int,
) -> torch.Tensor:
    """Logits [rows, keep, V] of the last ``keep`` of ``ids`` [rows, n] at rotary ``positions`` [n],
    their keys and values written at cache ``slots`` [n]; ``mask`` [n, S] (True = attend) over the first
    S slots. The model's own norms, activation, rotary embedding and weights; attention and the cache here."""
    inner = model.model
    rows, n = ids.shape
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, positions.view(1, -1))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    span = mask.shape[-1]
    for layer, k_buf, v_buf in zip(inner.layers, keys, values, strict=True):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = _linear(attn.q_proj, x).view(rows, n, -1, attn.head_dim).transpose(1, 2)
        k = _linear(attn.k_proj, x).view(rows, n, -1, attn.head_dim).transpose(1, 2)
        v = _linear(attn.v_proj, x).view(rows, n, -1, attn.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k_buf.index_copy_(2, slots, k)
        v_buf.index_copy_(2, slots, v)
        o = F.scaled_dot_product_attention(
            q, k_buf[:, :, :span], v_buf[:, :, :span], attn_mask=mask, scale=attn.scaling, enable_gqa=True
        )
        h = h + _linear(attn.o_proj, o.transpose(1, 2).reshape(rows, n, -1))
        mlp, x = layer.mlp, layer.post_attention_layernorm(h)
        h = h + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))
    return _linear(model.lm_head, inner.norm(h[:, -keep:]))


def _linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s product as the plain ``F.linear`` of its weight (whichever eager kernel the layer was
    given), which inductor prepacks for its own kernels when it freezes the weights."""
    return F.linear(x, layer.weight, layer.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Forward(torch.nn.Module):
    """``llama_forward`` as a module holding the model, so the compiler sees its weights as attributes it
    may freeze (constants it prepacks), not as inputs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> torch.Tensor:
        return llama_forward(self.model, *args)


def compiled_forward(model: torch.nn.Module) -> Any:
    """``llama_forward`` of ``model`` compiled once per model and process (kept on the model)."""
    fn = model.__dict__.get("_mtad_compiled_forward")
    if fn is None:
        # one compiled graph per (rows, tokens, keep) shape decoding meets; the attended length is dynamic
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        fn = torch.compile(_Forward(model))
        model.__dict__["_mtad_compiled_forward"] = fn
    return fn
