"""Feeding a draft that reads the target's features (:mod:`mtad.models.feature_draft`).

The draft reads, with each token x_p, the target's last hidden state f_{p-1}. The target's are known
for every committed position (its verification forward computes them: :class:`Features` keeps them);
a drafted token reads none (zeros), as the draft was trained. Drafted positions are never kept: after
a verification the draft's cache is cut back to the positions it read with the target's features, and
the accepted tokens are read again with them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mtad.decoding.kv import KVCache


class Features:
    """The target's last hidden state at each position it has run, one row ``[positions, hidden]``."""

    def __init__(self, hidden: int, device: torch.device) -> None:
        self.data = torch.zeros(0, hidden, device=device)

    def write(self, start: int, hidden: torch.Tensor) -> None:
        """Keep ``hidden`` [1, n, H] as the features of positions ``start`` .. ``start + n - 1``."""
        n = hidden.shape[1]
        if self.data.dtype != hidden.dtype:
            self.data = self.data.to(hidden.dtype)
        if start + n > self.data.shape[0]:
            grown = self.data.new_empty(max(64, 2 * (start + n)), self.data.shape[1])
            grown[: self.data.shape[0]] = self.data
            self.data = grown
        self.data[start : start + n] = hidden[0]

    def read(self, start: int, end: int) -> torch.Tensor:
        """Features of positions ``start`` .. ``end - 1`` ``[end - start, H]``."""
        return self.data[start:end]


class FeatureLM:
    """A feature-reading draft with a KV cache, fed like :class:`mtad.decoding.state.CachedLM`.

    ``context(tokens)`` runs the target over committed positions whose features are
    needed and not known yet (the prompt, before the first verification), as a timed target forward,
    in :meth:`prepare`."""

    def __init__(
        self,
        model: torch.nn.Module,
        vocab: int,
        features: Features,
        target_length: Callable[[], int],
        context: Callable[[torch.Tensor], None],
    ) -> None:
        self.model = model
        self.vocab = vocab
        self.cache = KVCache(model.config)
        self.columns: torch.Tensor = model.columns
        self.features = features
        self._target_length = target_length
        self._context = context
        self.read = 0  # tokens read
        self.exact = 0  # of which read with the target's own features (a prefix)
        self.drafting = False  # the context is read: further tokens are drafted ones

    @property
    def length(self) -> int:
        return self.read

    def prepare(self, tokens: torch.Tensor) -> None:
        """Before reading committed context ``tokens`` [B, n]: run the target over the positions whose
        features it needs and the target has not run yet (the prompt, before the first verification)."""
        ran, start, n = self._target_length(), self.read, tokens.shape[1]
        if not self.drafting and ran < start + n - 1:
            self._context(tokens[:1, ran - start : n - 1])

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, keep: int = 1, columns: bool = False) -> torch.Tensor:
        """Read ``tokens`` [B, n]: committed context after a rollback (with the target's features), or
        drafted tokens (with none); fp32 logits of the last ``keep`` positions."""
        start, n = self.read, tokens.shape[1]
        if not self.drafting:  # committed context
            if self._target_length() < start + n - 1:
                raise RuntimeError("the target has not run the context this draft reads: call prepare first")
            feats = self.features.read(max(start - 1, 0), start + n - 1)
            if start == 0:  # the text's first token has no previous position
                feats = torch.cat([feats.new_zeros(1, feats.shape[-1]), feats])
            feats = feats[None].expand(tokens.shape[0], -1, -1)
            self.exact += n
            self.drafting = True
        else:  # drafted tokens: the target has not run them
            feats = None
        self.read += n
        out = self.model(
            input_ids=tokens,
            features=feats,
            past_key_values=self.cache.past_key_values,
            use_cache=True,
            logits_to_keep=keep,
            shortlist_only=columns,
        )
        logits = out.logits[:, -keep:].float()
        return logits if columns else logits[..., : self.vocab]

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` tokens read, and never a drafted one: the next feed reads the
        accepted tokens again with the target's features."""
        self.read = self.exact = min(length, self.exact)
        self.drafting = False
        self.cache.crop(self.read)
        self.cache.keep_row(0)
