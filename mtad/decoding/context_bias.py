"""The draft's context n-gram bias: a draft that also copies from the context.

Replies often repeat spans of the prompt or of themselves (a name, a code identifier, a quoted phrase), and a
small draft follows such copies poorly. So each of the draft's logits gets ``weights[n - 1]`` added for every
order n whose last n tokens of the row also occur earlier in the row followed by that token (prompt lookup,
Saxena 2023, folded into the draft's own distribution). The decoders sample from, and judge by, the biased distribution: it *is*
the draft's q, so every rule stays exact; only how often the target agrees changes.

:class:`TokenRows` keeps the token ids a cache holds, row by row, through the same operations as the cache
(fan out, select, reorder, keep a tree path), so the bias reads each row's own text on the device with no
host read."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from mtad import sampling

ENV = "MTAD_CONTEXT_BIAS"
"""Operator override of a draft's weights: ``off``, or comma-separated weights for orders 1, 2, 3 …"""


class TokenRows:
    """The token ids held at each position of each row of a cache: ``ids[:, :length]`` (the cache's length)."""

    def __init__(self, device: torch.device) -> None:
        with torch.inference_mode():
            self.ids = torch.zeros(1, 0, dtype=torch.long, device=device)
        self._host: list[int] | None = []  # ids[0] as a list while there is one row and it is kept up to date

    def host_row(self) -> list[int]:
        """The one row's ids as a host list (at least its first ``length``): kept up by :meth:`write` while
        reading the fed tokens is free (:func:`~mtad.sampling.reads_free`), else read from ``ids`` once."""
        if self.ids.shape[0] != 1:
            raise ValueError("host_row needs a cache of one row")
        if self._host is None:
            self._host = self.ids[0].tolist()
        return self._host

    @torch.inference_mode()  # as the caches' buffers: changed in place
    def write(self, tokens: torch.Tensor, at: int) -> None:
        """``tokens`` [B, n] fed at positions ``at`` … (one held row fans out to B rows, as the caches do)."""
        rows, n = tokens.shape
        host = self._host
        if (
            host is not None
            and rows == 1
            and self.ids.shape[0] == 1
            and at <= len(host)
            and sampling.reads_free(tokens)
        ):
            del host[at:]
            host.extend(tokens[0].tolist())
        else:
            self._host = None
        ids = self.ids
        if ids.shape[0] != rows:
            ids = ids[:1].expand(rows, -1)
        if ids.shape[1] < at + n:
            grown = ids.new_zeros(rows, max(at + n, 2 * ids.shape[1]))
            grown[:, : min(at, ids.shape[1])] = ids[:, :at]
            ids = grown
        elif ids is not self.ids:
            ids = ids.clone()
        ids[:, at : at + n] = tokens
        self.ids = ids

    @torch.inference_mode()  # as the caches' buffers: changed in place
    def fan_out(self, rows: int) -> None:
        """Repeat the one row ``rows`` times."""
        if rows > 1 and self.ids.shape[0] == 1:
            self.ids = self.ids.expand(rows, -1).clone()
            self._host = None

    @torch.inference_mode()  # as the caches' buffers: changed in place
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (a device tensor) in that order."""
        self.ids = self.ids.index_select(0, index)
        self._host = None

    @torch.inference_mode()  # as the caches' buffers: changed in place
    def keep_positions(self, keep: list[int]) -> None:
        """Keep only the positions ``keep`` (in order)."""
        idx = torch.tensor(keep, device=self.ids.device)
        self.ids[:, : len(keep)] = self.ids.index_select(1, idx)
        self._host = None


def weights_of(model: torch.nn.Module, exact: bool = True) -> tuple[float, ...]:
    """The bias weights for orders 1, 2, … a draft runs with in a decoder (``exact``: one whose output distribution is
    the target's whatever q is, such as SD). ``MTAD_CONTEXT_BIAS``, if set: ``off``, or weights for every
    drafting decoder; else the draft config's ``mtad_context_bias`` (chosen on held-out replies) for the exact
    decoders only, and none for the others. MTAD's and BiLD's texts follow q, and the bias makes q favour
    repeats (MTAD's texts looped more with it), so the draft's own weights leave their text as it was."""
    wanted = os.environ.get(ENV, "").strip()
    if wanted:
        if wanted.lower() in ("off", "0", "none"):
            return ()
        try:
            weights = tuple(float(w) for w in wanted.split(","))
        except ValueError as exc:
            raise ValueError(f"{ENV} must be 'off' or weights such as 0,2,4; got {wanted!r}") from exc
    elif exact:
        weights = tuple(getattr(getattr(model, "config", None), "mtad_context_bias", None) or ())
    else:
        weights = ()
    if any(w < 0 for w in weights):
        raise ValueError(f"context bias weights must be non-negative; got {weights}")
    return weights if any(weights) else ()


def described(model: torch.nn.Module) -> dict[str, object]:
    """Which decoders a draft's bias serves, and its weights: what the bench records and the page states."""
    everywhere = weights_of(model, exact=False)
    return {"weights": list(weights_of(model)), "decoders": "all drafting" if everywhere else "exact"}


def context_bias(
    ids: torch.Tensor, length: int, weights: torch.Tensor, column_of: torch.Tensor | None, columns: int
) -> torch.Tensor:
    """The bias [B, columns] for the next token of each row of ``ids[:, :length]``: ``weights[n - 1]`` on every
    column whose token followed an earlier occurrence of the row's last n tokens, summed over the orders n.
    ``weights``: a 1-D float tensor on ``ids``' device (made once: a fresh one every call would copy from the
    host on each draft step). ``column_of`` [V]: each token's column (``columns`` for a token off a shortlist, whose q stays 0); None
    when the columns are the vocabulary.

    A position j matches to order n when the n tokens ending at j equal the row's last n: a cumulative product
    over the tokens back from j gives every order's match at once, and j's value is the sum of the weights of
    the orders it matches. Matches are nested (order n implies n - 1) and weights non-negative, so a token's
    bias, each order's weight once if any position after which it came matches that order, is the largest
    value of those positions: one ``scatter_reduce`` (amax) for all orders."""
    rows, orders = ids.shape[0], min(weights.shape[0], length - 1)
    bias = torch.zeros(rows, columns + 1, device=ids.device)
    if orders < 1:
        return bias[:, :columns]
    # windows[b, j, k] = ids[b, j - k] for each position j that has a next token (before the text, -1: no
    # token, so no match runs past its start)
    before = torch.nn.functional.pad(ids[:, : length - 1], (orders - 1, 0), value=-1)
    windows = before.unfold(1, orders, 1).flip(-1)  # [B, length - 1, orders]
    suffix = ids[:, length - orders : length].flip(-1)  # the row's last tokens, newest first
    matched = (windows == suffix.unsqueeze(1)).cumprod(-1)  # order k + 1 matched at position j
    value = matched.to(weights.dtype) @ weights[:orders]  # [B, length - 1]
    nxt = ids[:, 1:length]  # the token after each position
    cols = nxt if column_of is None else column_of[nxt]
    return bias.scatter_reduce_(1, cols.clamp_max(columns), value, "amax")[:, :columns]


def summed_weights(weights: torch.Tensor) -> list[list[float]]:
    """[o - 1][n - 1]: the bias of a position that matches n of o orders, the first n of ``weights`` (1-D, on
    the CPU) summed as :func:`context_bias` sums them (its product), so :func:`host_bias` gives its bits."""
    return [
        ((torch.arange(o)[None] < torch.arange(1, o + 1)[:, None]).float() @ weights[:o]).tolist()
        for o in range(1, weights.shape[0] + 1)
    ]


def host_bias(
    ids: list[int], length: int, values: Sequence[Sequence[float]], column_of: list[int] | None, columns: int
) -> dict[int, float]:
    """:func:`context_bias` of one row ``ids[:length]`` on the host, as {column: bias} for the columns it
    raises. ``values[o - 1][n - 1]``: the bias of a position that matches the row's last ``n`` tokens when
    ``o`` orders are looked at (:func:`summed_weights`: the device form's arithmetic, so the same bits).
    A few dozen Python operations where the device form runs a dozen tensor operations over the row: on the
    CPU, where each of those costs its dispatch, the host walk is the cheaper one."""
    orders = min(len(values), length - 1)
    found: dict[int, float] = {}
    if orders < 1:
        return found
    last, tail, table = ids[length - 1], ids[length - orders : length][::-1], values[orders - 1]
    for j in range(length - 1):
        if ids[j] != last:
            continue
        n = 1
        while n < orders and j >= n and ids[j - n] == tail[n]:
            n += 1
        col = ids[j + 1] if column_of is None else column_of[ids[j + 1]]
        if col < columns and table[n - 1] > found.get(col, -1.0):
            found[col] = table[n - 1]
    return found


class ContextBias:
    """The bias of one draft LM (:class:`~mtad.decoding.state.CachedLM` or its compiled twin), whose cache it
    gives a :class:`TokenRows` to keep: ``bias(lm)`` is what to add to the logits the LM just returned over its
    columns, and :meth:`add` adds it."""

    def __init__(self, lm: object, weights: Sequence[float]) -> None:
        self.weights = tuple(weights)
        columns: torch.Tensor | None = lm.columns
        device = next(lm.model.parameters()).device
        self.width = lm.vocab if columns is None else columns.numel()
        self.column_of = None
        if columns is not None:
            self.column_of = torch.full((lm.vocab,), self.width, dtype=torch.long, device=device)
            self.column_of[columns] = torch.arange(self.width, device=device)
        self.weight_tensor = torch.tensor(self.weights, dtype=torch.float32, device=device)
        self.host_values = summed_weights(self.weight_tensor.cpu())
        self.host_column_of = None if self.column_of is None else self.column_of.tolist()
        lm.cache.tokens = TokenRows(device)

    def __call__(self, lm: object) -> torch.Tensor:
        return context_bias(lm.cache.tokens.ids, lm.length, self.weight_tensor, self.column_of, self.width)

    def add(self, logits: torch.Tensor, lm: object) -> torch.Tensor:
        """``logits`` [B, C] (the LM's last output) plus the bias: worked out on the host for one row where
        reading is free (:func:`host_bias`), on the device otherwise (:func:`context_bias`)."""
        rows = lm.cache.tokens
        if logits.shape[0] != 1 or rows.ids.shape[0] != 1 or not sampling.reads_free(logits):
            return logits + self(lm)
        found = host_bias(rows.host_row(), lm.length, self.host_values, self.host_column_of, self.width)
        if not found:
            return logits
        cols = torch.tensor(list(found), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(found.values()), dtype=logits.dtype, device=logits.device)
        return logits.index_add(1, cols, bias[None])
