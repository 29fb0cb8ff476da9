"""Compiling before the clock starts: what a pair and its settings ask of the compiled engine, compiled once
per process before a timed generation, so that a decoder's speed is decoding's, not its first compile's."""

from __future__ import annotations

import logging
import time
import weakref

import torch

from mtad.decoding.fused import fused_enabled
from mtad.decoding.loop import decode
from mtad.decoding.spec import spec_of
from mtad.decoding.static_lm import compile_shapes, compiles_draft
from mtad.models.pair import ModelPair
from mtad.models.static_llama import discard_broken_cache
from mtad.settings import Settings

log = logging.getLogger(__name__)


def warm_up(pair: ModelPair, settings: Settings) -> bool:
    """Compile everything ``settings`` ask of ``pair`` on the compiled engine that this process has not
    compiled yet: the pair's forwards up to γ + 1 tokens (:func:`warm_up_pair`), then the settings' own shapes
    (:func:`warm_up_settings`). True when it compiled anything; nothing on the eager engine."""
    if pair.engine != "compiled":
        return False
    tokens = settings.gamma + 1
    pair_done = WARMED_TOKENS.get(pair.target, 0) >= tokens
    if not pair_done:
        warm_up_pair(pair, tokens)
    return warm_up_settings(pair, settings) or not pair_done


WARMED_TOKENS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
"""The most tokens a forward of each compiled pair (by its target) was compiled for by :func:`warm_up_pair`."""


def warm_up_pair(pair: ModelPair, tokens: int) -> float:
    """Compile what decoding asks of a pair on the compiled engine before anyone waits: the target's and
    the draft's forwards of 1 … ``tokens`` tokens in one row (the target's logits of all of them, the draft's
    of the last, as decoding asks), and the draft's one or two tokens in several rows
    (beams, Spectr's drafts: one graph serves every count from two on); the seconds it took. A draft that
    is not a Llama stays eager and compiles nothing. A failure that names a file of inductor's on-disk cache
    (a library truncated by a killed compile) costs that cache and one more compile, with a warning
    (:func:`~mtad.models.static_llama.discard_broken_cache`)."""
    t0 = time.perf_counter()
    try:
        _warm_up_pair(pair, tokens)
    except Exception as exc:
        named = discard_broken_cache(exc)
        if named is None:
            raise
        log.warning("compiling from inductor's on-disk cache failed (%s); compiling anew into an empty one", named)
        _warm_up_pair(pair, tokens)
    WARMED_TOKENS[pair.target] = max(WARMED_TOKENS.get(pair.target, 0), tokens)
    return time.perf_counter() - t0


def _warm_up_pair(pair: ModelPair, tokens: int) -> None:
    compile_shapes(pair.target, pair.vocab_size, tokens)
    if compiles_draft(pair):
        compile_shapes(pair.draft, pair.vocab_size, tokens, keep_all=False)
        # several rows (beams, Spectr's and SpecInfer's drafts) read one token, or two where every draft
        # was kept: the last draft, which the draft never read, and the target's token after it
        compile_shapes(pair.draft, pair.vocab_size, 2, rows=2, keep_all=False)
    if fused_enabled(pair):
        warm_up_bookkeeping(pair, tokens)


WARMED: weakref.WeakKeyDictionary[torch.nn.Module, set[tuple]] = weakref.WeakKeyDictionary()
"""The shape-deciding settings each compiled pair (by its target, where its graphs live) has generated with
in this process."""


def shape_key(settings: Settings) -> tuple:
    """What decides the shapes a generation compiles (the method, its draft's length, rows and search, greedy
    or sampled), not the values it computes with (τ, the warp, the seed)."""
    s = settings
    return (s.method, s.gamma, s.beams, s.num_drafts, s.draft_mode, s.is_greedy)


def needs_warm_up(pair: ModelPair, settings: Settings) -> bool:
    """True when :func:`warm_up_settings` would compile: the compiled engine, settings not yet seen."""
    return pair.engine == "compiled" and shape_key(settings) not in WARMED.get(pair.target, ())


def warm_up_settings(pair: ModelPair, settings: Settings) -> bool:
    """Before a timed generation on the compiled engine, after the pair's own warm-up (:func:`warm_up_pair`,
    one sequence's shapes), compile what these settings ask that no earlier generation in this process
    asked (a token tree's or several drafts' verification, the draft's search): a short untimed generation,
    whole drafts then the shorter ones of its end. True when it ran;
    False on the eager engine and for settings already seen. Without it a decoder's first run reports
    its compile as its speed."""
    if not needs_warm_up(pair, settings):
        return False
    ids = pair.encode("Say hello.")
    for _ in decode(pair, ids, settings.with_(max_new_tokens=3 * (settings.gamma + 1), seed=0)):
        pass
    widest = spec_of(settings.method).verify_tokens
    if widest is not None:  # a token tree's size varies with how much its candidates share: every count
        compile_shapes(pair.target, pair.vocab_size, widest(settings), tree=True)
    WARMED.setdefault(pair.target, set()).add(shape_key(settings))
    return True


def warm_up_bookkeeping(pair: ModelPair, tokens: int) -> None:
    """Compile AR's, SD's and MTAD's fused bookkeeping (:mod:`mtad.decoding.fused`) at the default settings
    before anyone waits: a short generation of each, drafting up to ``tokens`` − 1 and fewer at its end (a
    second draft length makes the graphs' shapes dynamic). Other settings compile on first use."""
    ids = pair.encode("Say hello.")
    for method in ("ar", "sd", "mtad"):
        settings = Settings(method=method, gamma=max(1, tokens - 1), max_new_tokens=2 * tokens + 1)
        for _ in decode(pair, ids, settings):
            pass
