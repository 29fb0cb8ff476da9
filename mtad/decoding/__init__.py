"""Decoders: each turns (pair, prompt ids, settings) into a stream of ``Step`` events.

Each decoder's module defines its ``SPEC`` (``mtad.decoding.spec.MethodSpec``: name, label, colour, the
settings it uses with their ranges, exactness, panel); the ``register`` calls below are the one list of
built-in methods. The CLI, the bench, the audit and the app all run a method through :func:`decode`;
docs/extending.md says how to add one.
"""

from __future__ import annotations

from collections.abc import Iterator

from mtad.decoding import autoregressive, bild, hf_assisted, mtad, mtad_tree, mtjd, specinfer, spectr, speculative
from mtad.decoding.rules import mtad_accept_length, mtad_passes
from mtad.decoding.spec import Decoder, MethodSpec, register, registry, spec_of
from mtad.decoding.state import reads_features
from mtad.events import Run, Step
from mtad.models.pair import ModelPair
from mtad.settings import Settings, uses_draft

for _module in (autoregressive, speculative, mtad, mtad_tree, bild, spectr, specinfer, hf_assisted, mtjd):
    register(_module.SPEC)

DECODERS: dict[str, MethodSpec] = registry()
"""Every registered method by name (the registry itself, so a method registered later is in it too)."""

__all__ = [
    "DECODERS",
    "Decoder",
    "MethodSpec",
    "decode",
    "encode_prompt",
    "generate",
    "mtad_accept_length",
    "mtad_passes",
    "refusal",
    "register",
]


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
    if (why := refusal(pair, settings.method)) is not None:
        raise ValueError(why)
    return spec_of(settings.method).run(pair, prompt_ids, settings)


def refusal(pair: ModelPair, method: str) -> str | None:
    """Why ``method`` cannot run on ``pair`` (a draft that reads the target's features needs a decoder that
    gives it them), or None."""
    spec = spec_of(method)
    if spec.drafts and reads_features(pair) and not spec.feature_draft:
        able = ", ".join(name for name, s in DECODERS.items() if s.drafts and s.feature_draft)
        return (
            f"the {pair.name} pair's draft reads the target's features, which {spec.short} does not give it; "
            f"run it with {able}"
        )
    return None


def generate(pair: ModelPair, prompt: str, settings: Settings, raw: bool = False) -> Run:
    """Decode a whole prompt into a ``Run`` (steps + text); the CLI and tests use this."""
    settings.validate()
    ids = encode_prompt(pair, prompt, settings, raw)
    run = Run(method=settings.method, prompt_ids=ids, settings=settings.to_dict(), device=str(pair.device))
    run.steps.extend(decode(pair, ids, settings))
    run.text = pair.decode(run.new_ids)
    return run
