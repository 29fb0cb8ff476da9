"""The one owner of a model's key/value cache during decoding.

Every decoder reaches a cache only through :class:`KVCache`: extend it with a forward, roll it back,
fan its one row out to several (beams, i.i.d. drafts), reorder the rows (beam search), keep one row,
or keep one path of a token tree. The layout behind these operations (today transformers 5's
``DynamicCache``: per layer, keys and values of shape ``[rows, heads, positions, head_dim]``) can
then change in one place. None of them reads a value on the host.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig

from mtad.decoding.context_bias import TokenRows


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
