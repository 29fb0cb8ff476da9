"""Decoders: each turns (pair, prompt ids, settings) into a stream of ``Step`` events.

``DECODERS`` is the one registry of methods: the CLI, the bench and the app all run a method through
:func:`decode`, and adding a decoder is one entry here (``mtad.settings.METHODS`` must list the same names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mtad.decoding.autoregressive import ar_step
from mtad.decoding.bild import bild_step
from mtad.decoding.hf_assisted import assisted_decode
from mtad.decoding.mtad import mtad_step
from mtad.decoding.mtad_tree import mtad_tree_step
from mtad.decoding.mtjd import mtjd_step
from mtad.decoding.rules import mtad_accept_length, mtad_passes
from mtad.decoding.specinfer import specinfer_step
from mtad.decoding.spectr import spectr_step
from mtad.decoding.speculative import sd_step
from mtad.decoding.state import DecodeState
from mtad.events import Run, Step
from mtad.pair import ModelPair
from mtad.settings import Settings, uses_draft

Decoder = Callable[[ModelPair, list[int], Settings], Iterator[Step]]
"""The one decoder signature: (pair, prompt ids, validated settings) -> Steps until the budget or EOS."""


@dataclass(frozen=True)
class Method:
    """A registered decoder and the settings it depends on (the bench sweeps and reports only these);
    ``step`` is the one-iteration function of a decoder built with :func:`stepwise`; ``exact``: its
    tokens follow the target's (warped) law exactly, so ``python -m mtad.audit`` must find no shift."""

    run: Decoder
    uses: tuple[str, ...] = ()
    step: Callable[[DecodeState], Step] | None = None
    exact: bool = False


def stepwise(step_fn: Callable[[DecodeState], Step], uses: tuple[str, ...] = (), exact: bool = False) -> Method:
    """A decoder from a one-iteration function on the shared ``DecodeState`` (ar, sd, mtad ...)."""

    def run(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> Iterator[Step]:
        st = DecodeState.start(pair, prompt_ids, settings)
        while st.remaining > 0:
            step = step_fn(st)
            yield step
            if step.eos:
                return

    return Method(run, uses, step_fn, exact)


DECODERS: dict[str, Method] = {
    "ar": stepwise(ar_step, exact=True),
    "sd": stepwise(sd_step, ("gamma",), exact=True),
    "mtad": stepwise(mtad_step, ("gamma", "beams", "tau", "draft_mode")),
    "mtad-tree": stepwise(mtad_tree_step, ("gamma", "beams", "tau", "draft_mode")),
    "bild": stepwise(bild_step, ("gamma", "tau1", "tau2")),
    "spectr": stepwise(spectr_step, ("gamma", "num_drafts"), exact=True),
    "specinfer": stepwise(specinfer_step, ("gamma", "num_drafts"), exact=True),
    "hf-assisted": Method(assisted_decode, ("gamma",), exact=True),
    # the reference MTAD approximates: K = gamma tokens a step by beam search (W = beams) over the target
    "mtjd": stepwise(mtjd_step, ("gamma", "beams", "draft_mode")),
}

__all__ = ["DECODERS", "Method", "decode", "encode_prompt", "generate", "mtad_accept_length", "mtad_passes"]


def check_fits(pair: ModelPair, n_prompt: int, settings: Settings) -> None:
    """Refuse a prompt + budget that runs past the models' context length."""
    limit = pair.context_length(uses_draft(settings.method))
    if n_prompt + settings.max_new_tokens > limit:
        raise ValueError(
            f"prompt ({n_prompt} tokens) + max new tokens ({settings.max_new_tokens}) exceeds the "
            f"model's context length of {limit} tokens; shorten the prompt or lower max new tokens"
        )


def encode_prompt(pair: ModelPair, prompt: str, settings: Settings, raw: bool = False) -> list[int]:
    """Tokenise a prompt (one user turn of a chat pair's template unless ``raw``) after checking
    it is non-empty and fits the context."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type some text to continue")
    ids = pair.encode(prompt, raw=raw)
    if not ids:
        raise ValueError("the prompt has no tokens")
    check_fits(pair, len(ids), settings)
    return ids


def decode(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> Iterator[Step]:
    """Yield one ``Step`` per iteration until ``max_new_tokens`` or EOS; never exceeds the budget."""
    settings.validate()
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    check_fits(pair, len(prompt_ids), settings)
    return DECODERS[settings.method].run(pair, prompt_ids, settings)


def generate(pair: ModelPair, prompt: str, settings: Settings, raw: bool = False) -> Run:
    """Decode a whole prompt into a ``Run`` (steps + text); the CLI and tests use this."""
    settings.validate()
    ids = encode_prompt(pair, prompt, settings, raw)
    run = Run(method=settings.method, prompt_ids=ids, settings=settings.to_dict(), device=str(pair.device))
    run.steps.extend(decode(pair, ids, settings))
    run.text = pair.decode(run.new_ids)
    return run
