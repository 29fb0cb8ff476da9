"""A Llama draft whose embedding and output head cover only a shortlist of the vocabulary.

A 49k-token head dominates the cost of a small draft. This draft keeps the target's tokenizer and
returns logits over the whole vocabulary, but computes them for ``shortlist_size`` frequent
tokens only; every other token gets ``-inf``, i.e. q = 0. Every verification rule stays exact
with q = 0 on some tokens (the target's residual covers them). Input tokens outside the
shortlist share one learned "rare token" row. The head is tied to the first ``shortlist_size``
embedding rows.

Its decoder layers may keep int8 weights (``int8_layers``): a small draft's forward on a CPU costs
about what it reads from memory, and int8 halves that.

The class is registered with transformers' Auto classes under ``model_type = "mtad_shortlist"``
when this module is imported, so ``AutoModelForCausalLM.from_pretrained`` loads such a draft
without ``trust_remote_code``: the code is this library's, not the checkpoint's.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, LlamaConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaModel, LlamaPreTrainedModel

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # older transformers (5.17, on the GPU machines) lack the helper

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The positions of ``hidden_states`` [B, T, H] whose logits are wanted: the last ``logits_to_keep``
        (0: all), or those a 1-D tensor of positions names (what transformers' own Llama did then)."""
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


from mtad.models.cpu_linear import replace_linears, stationary_linear
from mtad.models.devices import onednn_runs


class ShortlistConfig(LlamaConfig):
    """A Llama config plus the shortlist's size (the token ids themselves are a saved buffer)."""

    model_type = "mtad_shortlist"

    def __init__(self, shortlist_size: int = 8192, int8_layers: bool = False, **kwargs: Any) -> None:
        self.shortlist_size = shortlist_size
        self.int8_layers = int8_layers
        kwargs["tie_word_embeddings"] = False  # the head reads the embedding's rows itself
        super().__init__(**kwargs)


class ShortlistEmbedding(nn.Module):
    """Token id -> row of a ``[shortlist_size + 1, hidden]`` table; the last row is "rare token"."""

    def __init__(self, vocab_size: int, shortlist_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shortlist_size + 1, hidden))
        self.register_buffer("row_of", torch.full((vocab_size,), shortlist_size, dtype=torch.long))
        self.register_buffer("tokens", torch.arange(shortlist_size, dtype=torch.long))

    def set_shortlist(self, tokens: torch.Tensor) -> None:
        """Make ``tokens`` (distinct ids, most frequent first) the shortlist, in that row order."""
        k = self.weight.shape[0] - 1
        if tokens.numel() != k or tokens.unique().numel() != k:
            raise ValueError(f"the shortlist needs {k} distinct token ids, got {tokens.numel()}")
        self.tokens.copy_(tokens)
        self.row_of.fill_(k)
        self.row_of[tokens] = torch.arange(k, device=tokens.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.row_of[input_ids], self.weight)


@functools.cache
def int8_kernel_input(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype one row in ``dtype`` enters PyTorch's int8-weight kernel as on this CPU, None where it
    multiplies the dequantised matrix instead: bf16 as it is; fp32 rounded to bf16 where PyTorch runs AVX2
    or AVX-512 code, whose int8 kernel is vectorised for bf16 input and not for fp32 (so the rounded row
    beats the dense fp32 product there); not tried on other CPUs, so None.
    The draft's q is then what that rounded product gives, which every rule uses as it is."""
    if dtype == torch.bfloat16:
        return dtype
    if dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return torch.bfloat16
    return None


def int8_product(flat: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``flat @ (qweight * scale[:, None]).T`` by PyTorch's int8-weight kernel, ``flat`` [rows, in] entering it
    in ``scale``'s dtype (:func:`int8_kernel_input`) and the product returned in ``flat``'s."""
    return torch.ops.aten._weight_int8pack_mm(flat.to(scale.dtype), qweight, scale).to(flat.dtype)


class Int8Linear(nn.Module):
    """A bias-free linear layer with int8 weights and one scale per output row (symmetric, per-channel,
    weight-only quantisation); activations and outputs keep the model's dtype.

    One row on the CPU (SD's drafting) runs PyTorch's own int8-weight kernel (``aten._weight_int8pack_mm``),
    which reads half the bytes of a bf16 product and a quarter of an fp32 one, with its input as
    :func:`int8_kernel_input` says (fp32 rounded to bf16). Several rows (beams, prefill), other CPUs and other
    devices multiply by the dequantised matrix, kept after its first use: the int8 kernel is slower than the
    dense bf16 product from two rows on (MTAD's beams), and with unrounded fp32 input at any size. That dense
    product runs the kernel :mod:`mtad.models.kernels` chose for the model (``kernel``: oneDNN with the dense
    matrix prepacked, else the weight-first product)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self._kept: dict[str, tuple[tuple, torch.Tensor]] = {}  # name -> (what it was made from, tensor)
        self.kernel = "stationary"  # how the dequantised matrix is multiplied: mtad.models.kernels sets it at load

    def __deepcopy__(self, memo: dict) -> Int8Linear:
        """A copy of the weights and the kernel choice, without the products kept from them: they are
        remade on first use, and a oneDNN-packed one has no storage to copy."""
        new = Int8Linear(self.in_features, self.out_features).to(self.qweight.device)
        new.qweight = copy.deepcopy(self.qweight, memo)
        new.scale = copy.deepcopy(self.scale, memo)
        new.kernel = self.kernel
        new.train(self.training)
        memo[id(self)] = new
        return new

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 version of a bias-free ``linear``: row scale max|w| / 127, weights rounded to it."""
        if linear.bias is not None:
            raise ValueError("Int8Linear has no bias")
        return cls.from_weight(linear.weight)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8Linear:
        """The int8 layer that applies ``weight`` ``[out, in]``, quantised as :meth:`quantize` says."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        layer = cls(w.shape[1], w.shape[0]).to(w.device)
        layer.qweight.copy_((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        layer.scale.copy_(scale)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        kernel = self.kernel_tensors(x.dtype) if x.device.type == "cpu" and flat.shape[0] == 1 else None
        if kernel is not None:
            out = int8_product(flat, *kernel)
        elif self.kernel == "onednn" and x.device.type == "cpu" and not x.requires_grad and onednn_runs(x.dtype):
            out = torch.ops.mkldnn._linear_pointwise(
                flat.contiguous(), self.onednn_matrix(x.dtype), None, "none", [], ""
            )
        else:
            out = stationary_linear(flat, self.dense(x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def kernel_tensors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The int8 matrix and its row scales as PyTorch's int8 kernel takes them for one row in ``dtype`` on the
        CPU (:func:`int8_product`), or None where that row does not enter the kernel (:func:`int8_kernel_input`)."""
        kernel_input = int8_kernel_input(dtype)
        if kernel_input is None:
            return None
        if self.qweight.data_ptr() % 64:
            # weights mapped from the checkpoint file at an odd offset crashed the kernel (80 rows,
            # torch 2.13); a copy from PyTorch's allocator is 64-byte aligned
            self.qweight = self.qweight.clone()
        return self.qweight, self._keep("scale", kernel_input, lambda: self.scale.to(kernel_input))

    def onednn_matrix(self, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`dense` prepacked for oneDNN (what several rows multiply by when that is the kernel), kept."""
        return self._keep("onednn", dtype, lambda: torch.ops.mkldnn._reorder_linear_weight(self.dense(dtype), None))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`dequantize` in ``dtype``, made once and kept until the weights change."""
        return self._keep("dense", dtype, lambda: self.dequantize(dtype))

    def _keep(self, name: str, dtype: torch.dtype, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``'s tensor, remade only when the dtype asked for or the weights have changed."""
        made_from = (dtype, self.qweight.device, _stamp(self.qweight), _stamp(self.scale))
        kept = self._kept.get(name)
        if kept is None or kept[0] != made_from:
            kept = self._kept[name] = (made_from, make())
        return kept[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight matrix this layer applies, ``qweight * scale`` per row, ``[out, in]``."""
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor lives and, unless it is an inference tensor (which keeps none), its version
    counter: what a copy made from it depends on."""
    return t.data_ptr(), -1 if t.is_inference() else t._version


def _int8_linears(layers: nn.Module, quantize: bool) -> None:
    """Replace every ``nn.Linear`` under ``layers`` by an ``Int8Linear``: quantised from its weights,
    or empty (to be filled by loading a checkpoint)."""
    replace_linears(
        layers, Int8Linear.quantize if quantize else lambda child: Int8Linear(child.in_features, child.out_features)
    )


class ShortlistForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    """Llama layers between a shortlist embedding and a tied shortlist head; full-vocabulary logits."""

    config_class = ShortlistConfig
    config: ShortlistConfig

    def __init__(self, config: ShortlistConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config)
        self.model.embed_tokens = ShortlistEmbedding(config.vocab_size, config.shortlist_size, config.hidden_size)
        if config.int8_layers:
            _int8_linears(self.model.layers, quantize=False)
        self.vocab_size = config.vocab_size
        self._int8_head: tuple[tuple, Int8Linear, Int8Linear | None] | None = None  # see int8_head
        self.post_init()

    def quantize_layers(self) -> ShortlistForCausalLM:
        """Give the decoder layers int8 weights (in place; saved and loaded as such from then on)."""
        if not self.config.int8_layers:
            _int8_linears(self.model.layers, quantize=True)
            self.config.int8_layers = True
        return self

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ShortlistEmbedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        else:
            super()._init_weights(module)

    @classmethod
    def from_target(cls, target: Any, tokens: torch.Tensor, layers: tuple[int, ...]) -> ShortlistForCausalLM:
        """A draft made of a Llama target's ``layers`` (in order), final norm and embedding rows of
        ``tokens`` (the shortlist, most frequent first); the rare-token row is the rows' mean."""
        cfg = ShortlistConfig(
            shortlist_size=len(tokens), **{**target.config.to_dict(), "num_hidden_layers": len(layers)}
        )
        cfg.architectures = [cls.__name__]
        model = cls(cfg).to(torch.float32)
        emb = target.get_input_embeddings().weight.detach().float()
        with torch.no_grad():
            model.model.embed_tokens.set_shortlist(tokens)
            model.model.embed_tokens.weight.copy_(torch.cat([emb[tokens], emb.mean(0, keepdim=True)]))
            model.model.norm.load_state_dict(target.model.norm.state_dict())
            for mine, theirs in zip(model.model.layers, layers, strict=True):
                mine.load_state_dict(target.model.layers[theirs].state_dict())
        return model

    @property
    def columns(self) -> torch.Tensor:
        """The token id of each shortlist logit (``shortlist_only`` output), ``[shortlist_size]``."""
        return self.model.embed_tokens.tokens

    def get_output_embeddings(self) -> None:
        return None  # the head is the embedding's first rows, not a module to tie or resize

    def shortlist_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the shortlist only, ``[..., shortlist_size]`` (what training needs).

        A draft with int8 layers has an int8 head too when it runs (not when it trains): the shortlist
        rows quantised like the layers on first use, so SD's one-row drafting reads half the head's
        bytes. The input embedding keeps the rows as they are."""
        if self.config.int8_layers and not hidden.requires_grad:
            return self.int8_head()(hidden)
        return stationary_linear(hidden, self.model.embed_tokens.weight[: self.config.shortlist_size])

    def int8_head(self) -> Int8Linear:
        """The shortlist head as an int8 layer (what an int8 draft multiplies by when it runs): made from the
        embedding's shortlist rows on first use, and again only when they change; it multiplies several rows
        with the layers' kernel (:func:`mtad.models.kernels.use_linear_kernel`), whenever that was chosen."""
        weight = self.model.embed_tokens.weight[: self.config.shortlist_size]
        made_from = _stamp(weight)
        if self._int8_head is None or self._int8_head[0] != made_from:
            layer = next((m for m in self.model.layers.modules() if isinstance(m, Int8Linear)), None)
            self._int8_head = (made_from, Int8Linear.from_weight(weight), layer)
        _, head, layer = self._int8_head
        if layer is not None:  # every forward reads this: one attribute, not a walk over the modules
            head.kernel = layer.kernel
        return head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        shortlist_only: bool = False,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Like ``LlamaForCausalLM.forward``: logits ``[B, T, vocab_size]``, ``-inf`` off the shortlist.

        ``shortlist_only``: logits ``[B, T, shortlist_size]`` over :attr:`columns` instead, which
        spares a decoder's sampling and beam search the columns that are ``-inf`` anyway."""
        kwargs.pop("labels", None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        short = self.shortlist_logits(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        if shortlist_only:
            return CausalLMOutputWithPast(logits=short, past_key_values=out.past_key_values)
        logits = short.new_full((*short.shape[:-1], self.vocab_size), float("-inf"))
        logits.index_copy_(-1, self.model.embed_tokens.tokens, short)
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values)


AutoConfig.register(ShortlistConfig.model_type, ShortlistConfig, exist_ok=True)
AutoModelForCausalLM.register(ShortlistConfig, ShortlistForCausalLM, exist_ok=True)
