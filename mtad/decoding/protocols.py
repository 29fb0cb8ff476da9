"""What the decoders call on a model and on its key/value cache, written down once.

Two engines implement them: the eager one (:class:`~mtad.decoding.kv.CachedLM` over
:class:`~mtad.decoding.kv.KVCache`, transformers' forward and ``DynamicCache``) and the compiled one
(:class:`~mtad.decoding.static_lm.StaticLM` over :class:`~mtad.decoding.static_lm.StaticKV`, static buffers and
``torch.compile``); a draft that reads the target's features (:class:`~mtad.decoding.features.FeatureLM`) is a
:class:`LanguageModel` too. The decoders are typed against these alone, so either engine runs every decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from mtad.decoding.context_bias import TokenRows


@runtime_checkable
class Cache(Protocol):
    """A model's keys and values during decoding, ``[rows, heads, positions, head_dim]`` per layer. None of
    its operations reads a value on the host."""

    tokens: TokenRows | None
    """The token ids held, row by row, where a draft's context bias reads them (else None)."""

    @property
    def length(self) -> int:
        """Positions held."""
        ...

    @property
    def rows(self) -> int:
        """Rows held (beams, i.i.d. drafts; 1 for one sequence)."""
        ...

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (a rollback)."""
        ...

    def fan_out(self, rows: int) -> None:
        """Repeat the one row ``rows`` times."""
        ...

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [k] (a device tensor), in that order."""
        ...

    def keep_row(self, row: int) -> None:
        """Reduce the rows to one of them."""
        ...

    def reorder(self, parent: torch.Tensor) -> None:
        """Row i becomes old row ``parent[i]`` (beam search; from one row this fans out)."""
        ...

    def keep_positions(self, keep: list[int]) -> None:
        """Keep only the positions ``keep``, in order: the context and one path of a token tree."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """Every key and value tensor held."""
        ...


@runtime_checkable
class LanguageModel(Protocol):
    """A causal LM over a :class:`Cache` that is never re-encoded, only extended and rolled back."""

    model: torch.nn.Module
    vocab: int
    cache: Cache
    columns: torch.Tensor | None
    """A shortlist draft's token ids [C] of its logits' columns (None: the whole vocabulary)."""

    @property
    def length(self) -> int:
        """Tokens the cache holds."""
        ...

    def prepare(self, tokens: torch.Tensor) -> None:
        """Whatever must run before ``tokens`` [rows, n] are fed (a feature-reading draft runs the target)."""
        ...

    def feed(self, tokens: torch.Tensor, keep: int = 1, columns: bool = False) -> torch.Tensor:
        """Run ``tokens`` [rows, n] after the cached context: fp32 logits of the last ``keep`` positions,
        [rows, keep, V] (over :attr:`columns` only, [rows, keep, C], with ``columns``)."""
        ...

    def rollback(self, length: int) -> None:
        """Forget the positions beyond ``length``."""
        ...


@runtime_checkable
class TreeLanguageModel(LanguageModel, Protocol):
    """A :class:`LanguageModel` that also verifies a token tree in one forward: the target on either engine."""

    def feed_masked(self, tokens: torch.Tensor, positions: list[int], allow: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` [1, n] at rotary ``positions`` [n] attending where ``allow`` [n, past + n] is True:
        fp32 logits of every position, [1, n, V]."""
        ...
