"""transformers' sdpa attention with grouped-query heads left to the kernel on the CPU.

With a mask (a target verifying several drafted tokens after its cache), transformers' sdpa path
copies every key/value head ``num_key_value_groups`` times before attending, because CUDA's fast
kernels need that. PyTorch's CPU kernel takes the grouped heads as they are (``enable_gqa``), at
the same cost and with the same values, so the copies are pure overhead on every verification.
Everything else is transformers' own sdpa.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mtad_cpu_sdpa"


def cpu_gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, except that a masked grouped-query attention on the
    CPU runs with ``enable_gqa`` instead of repeated key/value heads."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if attention_mask is None or not grouped or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cpu_gqa_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_cpu_gqa_attention(model: torch.nn.Module) -> bool:
    """Switch a CPU model that runs transformers' sdpa to :func:`cpu_gqa_sdpa`; True if switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
