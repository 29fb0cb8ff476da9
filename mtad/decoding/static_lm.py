"""The compiled engine's side of decoding: a target or a draft over a static key/value buffer (:class:`StaticLM`).

:class:`StaticLM` answers the same calls as :class:`~mtad.decoding.state.CachedLM` (feed, a masked feed
for token trees, rollback, the cache's row and position operations), with
:func:`mtad.models.static_llama.llama_forward` over :class:`StaticKV`'s buffers. Only the shapes decoding
repeats are compiled: up to :data:`COMPILED_TOKENS` tokens in up to :data:`COMPILED_ROWS` rows (one new
token, a verification of γ + 1 tokens, beams), a token tree's verification up to :data:`TREE_TOKENS`; a
prompt's prefill runs the same function uncompiled. The attended length is dynamic (marked so before the
first compile), so a growing context never recompiles, and so is the row count from two rows on (any beam
width is one graph); each new (one row or several, tokens) shape compiles once per process. Rolling back is
moving the length: slots past it are masked and overwritten. On CUDA those repeated forwards replay CUDA
graphs (:mod:`mtad.decoding.graphs`) over buffers kept on the model between generations, a token tree's
padded to a few sizes (:data:`TREE_BUCKETS`).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch
import torch._dynamo

from mtad.decoding.context_bias import TokenRows
from mtad.decoding.graphs import ForwardGraphs, graphs_enabled
from mtad.models.devices import to_device
from mtad.models.pair import ModelPair
from mtad.models.static_llama import (
    FEW_QUERIES,
    gemv_layer_weights,
    gemv_tokens,
    hold_widths,
    int8_layer_weights,
    layer_weights,
    llama_forward,
    supports,
)

log = logging.getLogger(__name__)
COMPILED_TOKENS = FEW_QUERIES
COMPILED_ROWS = 16
TREE_BUCKETS = (8, 16, 24, 32, 48, 64)
"""The sizes a token tree's forward is padded to where forwards replay CUDA graphs (each shape a capture of
its own, and a tree's size changes every iteration): at most six captures, not one for every size up to
:data:`TREE_TOKENS`. A GPU runs a few more tokens in the same time; a CPU's cost grows with each token, so
there trees are not padded."""
TREE_TOKENS = TREE_BUCKETS[-1]
"""The most tokens a token tree's verification (the pending context, then every node) runs compiled: W = 8
beams of γ = 4 are up to 33, and most of MTAD-tree's verifications are smaller, as its beams share prefixes.
Past :data:`COMPILED_TOKENS` one graph, dynamic in the token count, serves them all on a CPU."""
CAPACITY_STEP = 256
GRAPH_CAPACITY_STEP = 2048
"""With CUDA graphs a forward attends over the whole capacity, and a larger one is captured anew: steps of
this many positions (a few MB of keys and values for a small model) make that rare."""


class StaticKV:
    """Keys and values in preallocated buffers, the same operations as :class:`~mtad.decoding.kv.KVCache`.

    ``length`` is a host integer (decoding always knows it): cropping moves it, and a forward writes its
    tokens at slots ``length …`` (then :meth:`wrote`). One set of buffers per row count is kept and reused,
    so beams fanning out and back to one row every iteration move between the same tensors (what CUDA
    graphs need: a graph reads the buffers it was captured over); only a larger capacity makes new ones,
    and bumps :attr:`epoch`. A set is one tensor, :attr:`base`, whose views are the layers' keys and values:
    moving rows is one ``index_select`` and one copy for the whole model, not one a layer's buffer (a beam
    search moves rows four times an iteration).

    Row operations copy only what differs: the first :attr:`shared` positions are the same in every row
    (the context the rows were fanned out from), so reordering beams moves their few drafted positions,
    not the whole context; and a kept set remembers how much of that context it still holds, so fanning
    out again copies only what was committed since."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device, step: int = CAPACITY_STEP) -> None:
        self.layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype, self.device = dtype, device
        self.step = step
        self.length = 0
        self.shared = 0  # leading positions equal in every row
        self.epoch = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.base: torch.Tensor | None = None  # every layer's keys, then values, [2 layers, rows, heads, S, d]
        self._sets: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = {}
        self._synced: dict[int, int] = {}  # row count -> leading positions of the shared context its set holds
        self.tokens: TokenRows | None = None  # the ids held, row by row, where a draft's context bias reads them

    @property
    def rows(self) -> int:
        """Batch rows held (1 before the first forward)."""
        return self.keys[0].shape[0] if self.keys else 1

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reset(self) -> None:
        """Empty, for a new generation: the buffers stay, what they hold is void."""
        self.length = self.shared = 0
        self._synced.clear()
        self.tokens = None

    def wrote(self, end: int) -> None:
        """A forward wrote slots ``length …`` up to ``end`` in every row: ``end`` positions are held now (in
        one row, all of them shared)."""
        self.length = end
        if self.rows == 1:
            self.shared = end

    @torch.inference_mode()  # the buffers are inference tensors, changed in place
    def reserve(self, rows: int, length: int) -> None:
        """Make room for ``length`` positions in ``rows`` rows, keeping what is held (capacity grows in
        steps of :attr:`step`, so buffers are rarely remade); from one row to several this fans it out."""
        if self.keys and rows == self.rows and length <= self.capacity:
            return
        if rows == self.rows:
            self._move(torch.arange(rows, device=self.device), length)
        else:  # every row a copy of the first
            self._move(torch.zeros(rows, dtype=torch.long, device=self.device), length, copies=True)

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (a kept set's copy of them is stale from now on)."""
        self.length = min(self.length, length)
        self._forget_from(self.length)

    def fan_out(self, rows: int) -> None:
        """Repeat the one row ``rows`` times (nothing to do while the cache is empty)."""
        if rows > 1 and self.length and self.rows != rows:
            self.reserve(rows, self.length)
            if self.tokens is not None:
                self.tokens.fan_out(rows)

    @torch.inference_mode()  # the buffers are inference tensors, changed in place
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (a device tensor, so no host read) in that order."""
        if self.length:
            self._move(index, self.length)
            if self.tokens is not None:
                self.tokens.select_rows(index)

    def keep_row(self, row: int) -> None:
        """Reduce a fanned-out cache to one of its rows."""
        if self.rows > 1:
            self.select_rows(torch.tensor([row], device=self.device))

    def reorder(self, parent: torch.Tensor) -> None:
        """Row i becomes old row ``parent[i]`` (beam search; from one row this also fans out)."""
        self.select_rows(parent)

    @torch.inference_mode()  # the buffers are inference tensors, changed in place
    def keep_positions(self, keep: list[int]) -> None:
        """Keep only the positions ``keep`` (in order), e.g. the context and one path of a token tree."""
        if self.base is not None:
            idx = torch.tensor(keep, device=self.device)
            self.base[:, :, :, : len(keep)] = self.base.index_select(3, idx)
        self.length = len(keep)
        self._forget_from(next((i for i, k in enumerate(keep) if i != k), len(keep)))
        if self.tokens is not None:
            self.tokens.keep_positions(keep)

    def tensors(self) -> list[torch.Tensor]:
        """Every key and value buffer held (what the cache costs in memory)."""
        return self.keys + self.values

    def _forget_from(self, position: int) -> None:
        """Positions from ``position`` on changed here: other rows and kept sets no longer hold them."""
        self.shared = min(self.shared, position)
        for rows, held in self._synced.items():
            self._synced[rows] = min(held, position)

    def _move(self, index: torch.Tensor, length: int, copies: bool = False) -> None:
        """Rows ``index`` of what is held become the rows, in buffers with room for ``length`` positions
        (``copies``: ``index`` names one row only). Positions every row shares, and that the destination
        holds already, are not copied."""
        rows, n, shared = index.numel(), self.length, self.shared
        copies = copies or self.rows == 1
        capacity = max(self.capacity, -(-length // self.step) * self.step)
        if capacity != self.capacity:
            start = 0
        elif rows == self.rows:
            start = shared  # rows move within the set: the shared positions are already there
        else:
            start = min(self._synced.get(rows, 0), shared)

        def window() -> torch.Tensor | None:
            """Positions ``start`` … ``n`` of every buffer of the current set (None when there are none)."""
            return self.base.narrow(3, start, n - start) if n > start and self.base is not None else None

        spans = window()
        picked = None if spans is None else spans.index_select(1, index)
        if rows != self.rows or capacity != self.capacity:
            if self.keys:
                self._synced[self.rows] = shared
            self._allocate(rows, capacity)
            spans = window()  # the new set's
        if picked is not None:  # one copy for every layer's keys and values
            spans.copy_(picked)
        if rows == 1 or copies:  # one row, or copies of one row
            self.shared = n

    def _allocate(self, rows: int, capacity: int) -> None:
        """Make the kept set of ``rows`` rows and ``capacity`` positions current (new and zeroed if there is
        none; a new capacity drops every kept set); what it holds is the caller's to fill."""
        if capacity != self.capacity:
            self._sets.clear()
            self._synced.clear()
            self.epoch += 1
        if rows in self._sets:
            self.base, self.keys, self.values = self._sets[rows]
            return
        shape = (2 * self.layers, rows, self.kv_heads, capacity, self.head_dim)
        self.base = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.keys, self.values = list(self.base[: self.layers].unbind(0)), list(self.base[self.layers :].unbind(0))
        for buf in self.keys + self.values:
            torch._dynamo.mark_static(buf, 1)  # the heads and the head width are a model's (:func:`hold_widths`)
            torch._dynamo.mark_static(buf, 3)
            torch._dynamo.mark_dynamic(buf, 2)  # a larger capacity is the same compiled graph
            if rows > 1:
                torch._dynamo.mark_dynamic(buf, 0)  # so is another count of beams or drafts
        self._sets[rows] = (self.base, self.keys, self.values)


class StaticLM:
    """:class:`~mtad.decoding.state.CachedLM` on the compiled engine: same calls, a static cache."""

    def __init__(self, model: torch.nn.Module, vocab: int, compile: bool = True, graphs: bool | None = None) -> None:
        """``graphs``: replay the repeated forwards from CUDA graphs (None: on CUDA unless the operator turned
        them off, :func:`~mtad.decoding.graphs.graphs_enabled`); True on a CPU runs the same fixed-input
        path with plain calls."""
        why = supports(model)
        if why:
            raise ValueError(f"the compiled engine cannot run this model: {why}")
        self.model = model
        self.vocab = vocab
        param = next(model.parameters())
        self.graphs: ForwardGraphs | None = None
        if graphs if graphs is not None else graphs_enabled(param.device):
            self.cache, self.graphs = _check_out(self, model, param)
        else:
            self.cache = StaticKV(model.config, param.dtype, param.device)
        # a shortlist draft computes logits for some tokens only (the rest are -inf), as in CachedLM.feed
        self.columns: torch.Tensor | None = getattr(model, "columns", None)
        self.compile = compile  # False: the same forward, uncompiled (what a prefill runs)
        self.layers = [layer_weights(layer) for layer in model.model.layers]
        self.one_row, self.one_row_tokens = one_row_layers(model)
        hold_widths(self.layers, self.one_row)

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        return self.cache.length

    def rollback(self, length: int) -> None:
        """Forget cached positions beyond ``length``."""
        self.cache.crop(length)

    def prepare(self, tokens: torch.Tensor) -> None:
        """Nothing to run before a forward (as ``CachedLM.prepare``)."""

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, keep: int = 1, columns: bool = False) -> torch.Tensor:
        """Run ``tokens`` [B, n] after the cached context; fp32 logits of the last ``keep`` positions
        (``columns``: over :attr:`columns` only when the model has a shortlist, as ``CachedLM.feed``)."""
        return self._run(tokens, None, None, keep, columns)

    @torch.inference_mode()
    def feed_masked(self, tokens: torch.Tensor, positions: list[int], allow: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` [1, n] at rotary ``positions`` with ``allow`` [n, past + n] (True = attend), e.g. a
        token tree; fp32 logits of every position [1, n, V]. Replayed from CUDA graphs, the forward runs
        padded to one of :data:`TREE_BUCKETS` (:func:`pad_tree`), and the padding is rolled back after it."""
        n, past = tokens.shape[1], self.cache.length
        size = self._tree_size(n)
        if size > n:
            tokens, positions, allow = pad_tree(tokens, positions, allow, size)
        logits = self._run(tokens, torch.tensor(positions), allow, size, most=TREE_TOKENS)
        self.rollback(past + n)
        return logits[:, :n]

    def _tree_size(self, n: int) -> int:
        """How many tokens a tree forward of ``n`` runs: the smallest bucket that holds them where forwards
        replay graphs and this one would (a context is cached), else ``n``."""
        if self.graphs is None or not self.cache.length:
            return n
        return next((b for b in TREE_BUCKETS if b >= n), n)

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        allow: torch.Tensor | None,
        keep: int,
        columns: bool = False,
        most: int = COMPILED_TOKENS,
    ) -> torch.Tensor:
        """One forward; ``positions`` and ``allow`` None: the next positions, causal attention. Compiled
        (and from graphs) when a context is cached and it has at most ``most`` tokens."""
        rows, n = tokens.shape
        past = self.cache.length
        self.cache.reserve(rows, past + n)  # from one row to several, this fans the context out
        repeated = past > 0 and n <= most and rows <= COMPILED_ROWS
        compiled = self.compile and repeated
        layers = self.one_row if self.one_row is not None and rows == 1 and n <= self.one_row_tokens else self.layers
        cache = self.cache

        def forward(ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            args = (ids, pos, slots, mask, cache.keys, cache.values, keep, layers)
            return llama_forward(self.model, *args, compiled=compiled)

        if self.graphs is not None and repeated:
            key = (rows, n, keep, layers is self.one_row, compiled, cache.keys[0].data_ptr())
            logits = self.graphs.run(key, tokens, past, cache.capacity, cache.epoch, forward, positions, allow)
        else:
            dev = cache.device
            if allow is None:
                allow = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
            slots = torch.arange(past, past + n, device=dev)
            pos = slots if positions is None else to_device(positions, dev)
            logits = forward(tokens, pos, slots, to_device(allow, dev))
        self.cache.wrote(past + n)
        if cache.tokens is not None:
            cache.tokens.write(tokens, past)
        if self.columns is None or columns:
            return logits[..., : self.vocab].float()
        full = logits.new_full((*logits.shape[:-1], self.vocab), float("-inf"), dtype=torch.float32)
        return full.index_copy_(-1, self.columns, logits.float())


def pad_tree(
    tokens: torch.Tensor, positions: list[int], allow: torch.Tensor, size: int
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """A masked forward's inputs (:meth:`StaticLM.feed_masked`) padded to ``size`` tokens: each padding
    token attends to itself only and no real token attends to it, so the real tokens' logits and keys are
    the unpadded forward's; its keys land in slots past the cache's length, masked and overwritten later."""
    n = tokens.shape[1]
    past = allow.shape[1] - n
    padded = torch.zeros(size, past + size, dtype=torch.bool, device=allow.device)
    padded[:n, : past + n] = allow
    padded[n:, past + n :] = torch.eye(size - n, dtype=torch.bool, device=allow.device)
    extra = tokens.new_zeros(tokens.shape[0], size - n)
    return torch.cat([tokens, extra], dim=1), positions + [positions[-1]] * (size - n), padded


def one_row_layers(model: torch.nn.Module) -> tuple[list | None, int]:
    """The layers' tensors a one-row forward of a few tokens multiplies by when they differ from every other
    forward's, and up to how many tokens: an int8 draft's for the int8 kernel where it takes the draft's
    dtype (bf16, or fp32 rounded to bf16 on AVX2 and AVX-512), one token, as on the eager engine; a plain
    model's for inductor's reductions (the ``gemv`` form), as many tokens as that form is the faster one for its
    dtype on this CPU (:func:`~mtad.models.static_llama.gemv_tokens`); else (None, 0)."""
    int8 = [int8_layer_weights(layer) for layer in model.model.layers]
    if all(int8):
        return int8, 1
    gemv = [gemv_layer_weights(layer) for layer in model.model.layers]
    if all(gemv):
        return gemv, gemv_tokens(next(model.parameters()).dtype)
    return None, 0


def products(pair: ModelPair) -> dict[str, dict[str, str | int]]:
    """How each model of a pair on the compiled engine multiplies (``int8``, ``gemv``, ``packed`` for
    oneDNN's packed products, ``plain``): in one row up to ``one_row_tokens`` tokens, and otherwise; what
    the bench records beside the linear kernels. Empty on the eager engine."""
    if pair.engine != "compiled":
        return {}
    out = {}
    for role, model in (("draft", pair.draft), ("target", pair.target)):
        if supports(model) is None:
            other = layer_weights(model.model.layers[0])[1]
            one, tokens = one_row_layers(model)
            out[role] = {"one_row": one[0][1] if one else other, "one_row_tokens": tokens, "several": other}
    return out


def _check_out(lm: StaticLM, model: torch.nn.Module, param: torch.Tensor) -> tuple[StaticKV, ForwardGraphs]:
    """Pooled buffers and their captured graphs for ``lm``, kept on the model between generations (a
    generation's graphs serve the next one) and handed back when ``lm`` is gone; two generations at once
    (the page's two lanes) each hold their own."""
    free: list[tuple[StaticKV, ForwardGraphs]] = model.__dict__.setdefault("_mtad_graph_slabs", [])
    try:
        cache, graphs = free.pop()
    except IndexError:
        cache = StaticKV(model.config, param.dtype, param.device, step=GRAPH_CAPACITY_STEP)
        graphs = ForwardGraphs(capture=param.device.type == "cuda")
    cache.reset()
    weakref.finalize(lm, free.append, (cache, graphs))
    return cache, graphs


def compile_shapes(
    model: torch.nn.Module, vocab: int, tokens: int, rows: int = 1, keep_all: bool = True, tree: bool = False
) -> float:
    """Compile the forwards of ``rows`` rows and 1 … ``tokens`` new tokens (AR's step and every
    verification up to γ = tokens − 1) before anyone waits on them; the seconds it took. They keep the logits
    of every new token (a verification's), or with ``keep_all`` False of the last (a draft's step): the head
    runs in the compiled graph, so each is a graph of its own. ``tree``: one row's masked forwards at given
    positions instead, up to :data:`TREE_TOKENS` (:meth:`StaticLM.feed_masked`, a token tree's verification:
    graphs of their own)."""
    t0 = time.perf_counter()
    lm = StaticLM(model, vocab)
    device = lm.cache.device
    lm.feed(torch.zeros((rows, 1), dtype=torch.long, device=device))  # a context: compiled shapes follow one
    for n in range(1, min(tokens, TREE_TOKENS if tree else COMPILED_TOKENS) + 1):
        ids = torch.zeros((rows, n), dtype=torch.long, device=device)
        if tree:
            with torch.inference_mode():  # as the decoders make the mask: the graphs guard on it
                allow = torch.ones(n, n + 1, dtype=torch.bool).tril(diagonal=1)
            lm.feed_masked(ids, list(range(1, n + 1)), allow)
        else:
            lm.feed(ids, keep=n if keep_all else 1)
        lm.rollback(1)
    return time.perf_counter() - t0


def compiles_draft(pair: ModelPair) -> bool:
    """Whether the pair's draft runs on the compiled engine: the pair's engine is compiled and the draft's
    layers are Llama layers (a shortlist draft's are); any other draft stays eager beside a compiled target."""
    return pair.engine == "compiled" and supports(pair.draft) is None
