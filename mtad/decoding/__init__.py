"""Decoders: each turns (pair, prompt ids, settings) into a stream of ``Step`` events.

Each decoder's module defines its ``SPEC`` (``mtad.decoding.spec.MethodSpec``: name, label, colour, the
settings it uses with their ranges, exactness, panel); the ``register`` calls below are the one list of
built-in methods, run before any module of this package is used. The CLI, the bench, the audit and the app
all run a method through :func:`decode` or :func:`generate`; docs/extending.md says how to add one.
"""

from __future__ import annotations

from mtad.decoding import autoregressive, bild, hf_assisted, mtad, mtad_tree, mtjd, specinfer, spectr, speculative
from mtad.decoding.loop import check_fits, check_prompt_text, decode, encode_prompt, refusal
from mtad.decoding.precompile import warm_up
from mtad.decoding.rules import mtad_accept_length, mtad_passes
from mtad.decoding.spec import Decoder, MethodSpec, check, register, registry
from mtad.events import Run
from mtad.models.pair import ModelPair
from mtad.settings import Settings

for _module in (autoregressive, speculative, mtad, mtad_tree, bild, spectr, specinfer, hf_assisted, mtjd):
    register(_module.SPEC)

DECODERS: dict[str, MethodSpec] = registry()
"""Every registered method by name (the registry itself, so a method registered later is in it too)."""

__all__ = [
    "check_prompt_text",
    "DECODERS",
    "Decoder",
    "MethodSpec",
    "check_fits",
    "decode",
    "encode_prompt",
    "generate",
    "mtad_accept_length",
    "mtad_passes",
    "refusal",
    "register",
    "warm_up",
]


def generate(pair: ModelPair, prompt: str, settings: Settings, raw: bool = False, compile_first: bool = True) -> Run:
    """Decode a whole prompt into a ``Run`` (Steps, then the text). On the compiled engine the shapes these
    settings ask for are compiled first, untimed (:func:`warm_up`; free once done in this process), unless
    ``compile_first`` is False: then the first Steps' seconds include the compile."""
    check(settings)
    ids = encode_prompt(pair, prompt, settings, raw)
    if compile_first:
        warm_up(pair, settings)
    run = Run(method=settings.method, prompt_ids=ids, settings=settings.to_dict(), device=str(pair.device))
    run.steps.extend(decode(pair, ids, settings))
    run.text = pair.decode(run.new_ids)
    return run
