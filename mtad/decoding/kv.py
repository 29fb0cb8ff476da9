"""The eager engine: a model over transformers' ``DynamicCache`` (:class:`CachedLM`), and the one owner of
that cache during decoding (:class:`KVCache`).

Every decoder reaches a cache only through :class:`KVCache`: extend it with a forward, roll it back,
fan its one row out to several (beams, i.i.d. drafts), reorder the rows (beam search), keep one row,
or keep one path of a token tree. The layout behind these operations (today transformers 5's
``DynamicCache``: per layer, keys and values of shape ``[rows, heads, positions, head_dim]``) can
then change in one place. None of them reads a value on the host.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PretrainedConfig

from mtad.decoding.context_bias import TokenRows

if TYPE_CHECKING:
    from mtad.decoding.features import Features


class KVCache:
    """A model's cache of keys and values, the operations decoding needs, and nothing else."""

    def __init__(self, config: PretrainedConfig) -> None:
        self._cache = DynamicCache(config=config)
        self.tokens: TokenRows | None = None  # the ids held, row by row, where a draft's context bias reads them

    @property
    def past_key_values(self) -> DynamicCache:
        """What a model's forward takes as ``past_key_values`` (and extends in place)."""
        return self._cache

    @property
    def length(self) -> int:
        """Positions held (0 before the first forward)."""
        return self._cache.get_seq_length()

    @property
    def rows(self) -> int:
        """Batch rows held (1 before the first forward)."""
        return self._cache.layers[0].keys.shape[0] if self.length else 1

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (transformers 5's ``crop`` takes minus the count)."""
        extra = self.length - length
        if extra > 0:
            self._cache.crop(-extra)

    def fan_out(self, rows: int) -> None:
        """Repeat the one row ``rows`` times (nothing to do while the cache is empty)."""
        if rows > 1 and self.length:
            self._cache.batch_repeat_interleave(rows)
            if self.tokens is not None:
                self.tokens.fan_out(rows)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (a device tensor, so no host read) in that order."""
        if self.length:
            self._cache.batch_select_indices(index)
            if self.tokens is not None:
                self.tokens.select_rows(index)

    def keep_row(self, row: int) -> None:
        """Reduce a fanned-out cache to one of its rows."""
        if self.rows > 1:
            self.select_rows(torch.tensor([row], device=self._cache.layers[0].keys.device))

    def reorder(self, parent: torch.Tensor) -> None:
        """Row i becomes old row ``parent[i]`` (beam search; from one row this also fans out)."""
        if self.length:
            self._cache.reorder_cache(parent)
            if self.tokens is not None:
                self.tokens.select_rows(parent)

    def keep_positions(self, keep: list[int]) -> None:
        """Keep only the positions ``keep`` (in order), e.g. the context and one path of a token tree."""
        for layer in self._cache.layers:
            idx = torch.tensor(keep, device=layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)
        if self.tokens is not None:
            self.tokens.keep_positions(keep)

    def tensors(self) -> list[torch.Tensor]:
        """Every key and value tensor held (what the cache costs in memory)."""
        return [t for layer in self._cache.layers if layer.keys is not None for t in (layer.keys, layer.values)]


class CachedLM:
    """A causal LM with a KV cache that is never re-encoded, only extended and cropped."""

    def __init__(self, model: torch.nn.Module, vocab: int, features: Features | None = None) -> None:
        self.model = model
        self.vocab = vocab
        self.cache = KVCache(model.config)
        self.features = features  # where to keep the last hidden states, for a draft that reads them
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # a shortlist draft computes logits for some tokens only (the rest are -inf): see feed
        self.columns: torch.Tensor | None = getattr(model, "columns", None)

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        return self.cache.length

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, keep: int = 1, columns: bool = False) -> torch.Tensor:
        """Run ``tokens`` [B, n] after the cached context; fp32 logits of the last ``keep`` positions.

        ``columns``: over :attr:`columns` only when the model has a shortlist (``[B, keep, len(columns)]``),
        over the whole vocabulary otherwise."""
        kwargs = {"logits_to_keep": keep} if self._keep else {}
        short = columns and self.columns is not None
        if short:
            kwargs["shortlist_only"] = True
        if self.features is not None:
            start = self.length
            hidden = self.model.get_decoder()(
                input_ids=tokens, past_key_values=self.cache.past_key_values, use_cache=True
            ).last_hidden_state
            self.features.write(start, hidden)
            return self.model.get_output_embeddings()(hidden[:, -keep:])[..., : self.vocab].float()
        past = self.length
        out = self.model(input_ids=tokens, past_key_values=self.cache.past_key_values, use_cache=True, **kwargs)
        if self.cache.tokens is not None:
            self.cache.tokens.write(tokens, past)
        return out.logits[:, -keep:].float() if short else out.logits[:, -keep:, : self.vocab].float()

    @torch.inference_mode()
    def feed_masked(self, tokens: torch.Tensor, positions: list[int], allow: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` [1, n] at rotary ``positions`` with ``allow`` [n, past + n] (True = attend), e.g. a
        token tree; fp32 logits of every position [1, n, V]."""
        device, past = tokens.device, self.length
        out = self.model(
            input_ids=tokens,
            attention_mask=additive_mask(allow, self.model.dtype).to(device)[None, None],
            position_ids=torch.tensor([positions], device=device),
            past_key_values=self.cache.past_key_values,
            use_cache=True,
        )
        if self.cache.tokens is not None:
            self.cache.tokens.write(tokens, past)
        return out.logits[..., : self.vocab].float()

    def rollback(self, length: int) -> None:
        """Forget cached positions beyond ``length``."""
        self.cache.crop(length)

    def prepare(self, tokens: torch.Tensor) -> None:
        """Nothing to run before a forward (a feature-reading draft runs the target here)."""


def additive_mask(allow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' additive form of a boolean attention mask, in the model's dtype (it joins the scores):
    0 where ``allow``, the dtype's lowest value elsewhere."""
    return torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)
