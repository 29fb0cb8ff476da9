"""Decoders: each turns (pair, prompt ids, settings) into a stream of ``Step`` events."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mtad.decoding.autoregressive import ar_step
from mtad.decoding.bild import bild_step
from mtad.decoding.mtad import mtad_step
from mtad.decoding.mtad_tree import mtad_tree_step
from mtad.decoding.rules import mtad_accept_length, mtad_passes
from mtad.decoding.specinfer import specinfer_step
from mtad.decoding.spectr import spectr_step
from mtad.decoding.speculative import sd_step
from mtad.decoding.state import DecodeState
from mtad.events import Run, Step
from mtad.settings import Settings

STEPS: dict[str, Callable[[DecodeState], Step]] = {"ar": ar_step, "sd": sd_step, "mtad": mtad_step}
STEPS["mtad-tree"] = mtad_tree_step
STEPS["bild"] = bild_step
STEPS["spectr"] = spectr_step
STEPS["specinfer"] = specinfer_step

__all__ = ["decode", "encode_prompt", "generate", "mtad_accept_length", "mtad_passes"]


def check_fits(pair, n_prompt: int, settings: Settings) -> None:  # noqa: ANN001
    """Refuse a prompt + budget that runs past the models' context length."""
    limit = pair.context_length(settings.method != "ar")
    if n_prompt + settings.max_new_tokens > limit:
        raise ValueError(
            f"prompt ({n_prompt} tokens) + max new tokens ({settings.max_new_tokens}) exceeds the "
            f"model's context length of {limit} tokens; shorten the prompt or lower max new tokens"
        )


def encode_prompt(pair, prompt: str, settings: Settings, raw: bool = False) -> list[int]:  # noqa: ANN001
    """Tokenise a prompt (one user turn of a chat pair's template unless ``raw``) after checking
    it is non-empty and fits the context."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type some text to continue")
    ids = pair.encode(prompt, raw=raw)
    if not ids:
        raise ValueError("the prompt has no tokens")
    check_fits(pair, len(ids), settings)
    return ids


def decode(pair, prompt_ids: list[int], settings: Settings) -> Iterator[Step]:  # noqa: ANN001
    """Yield one ``Step`` per iteration until ``max_new_tokens`` or EOS; never exceeds the budget."""
    settings.validate()
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    check_fits(pair, len(prompt_ids), settings)
    st = DecodeState.start(pair, prompt_ids, settings)
    step_fn = STEPS[settings.method]
    while st.remaining > 0:
        step = step_fn(st)
        yield step
        if step.eos:
            return


def generate(pair, prompt: str, settings: Settings, raw: bool = False) -> Run:  # noqa: ANN001
    """Decode a whole prompt into a ``Run`` (steps + text); the CLI and tests use this."""
    settings.validate()
    ids = encode_prompt(pair, prompt, settings, raw)
    run = Run(method=settings.method, prompt_ids=ids, settings=settings.to_dict(), device=str(pair.device))
    run.steps.extend(decode(pair, ids, settings))
    run.text = pair.decode(run.new_ids)
    return run
