"""From a prompt to Steps: tokenise and check it, then run its method's decoder (the registry's)."""

from __future__ import annotations

from collections.abc import Iterator

from mtad.decoding.iteration import run_steps
from mtad.decoding.spec import check, registry, spec_of, uses_draft
from mtad.decoding.state import reads_features
from mtad.events import Step
from mtad.models.pair import ModelPair
from mtad.settings import Settings


def check_fits(pair: ModelPair, n_prompt: int, settings: Settings) -> None:
    """Refuse a prompt + budget that runs past the models' context length."""
    limit = pair.context_length(uses_draft(settings.method))
    if n_prompt + settings.max_new_tokens > limit:
        raise ValueError(
            f"prompt ({n_prompt} tokens) + max new tokens ({settings.max_new_tokens}) exceeds the "
            f"model's context length of {limit} tokens; shorten the prompt or lower max new tokens"
        )


def check_prompt_text(prompt: object) -> None:
    """ValueError unless ``prompt`` is non-empty text that UTF-8 can encode: a lone surrogate (a broken copy and
    paste, or a command-line byte that is not UTF-8) would otherwise fail inside the tokenizer."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type some text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(prompt[exc.start])
        raise ValueError(
            f"the prompt holds a character that is not text (U+{code:04X}, a lone surrogate, at character "
            f"{exc.start + 1:,}): often what is left of a broken copy and paste or of bytes that are not UTF-8; "
            "remove it or paste the text again"
        ) from None


def encode_prompt(pair: ModelPair, prompt: str, settings: Settings, raw: bool = False) -> list[int]:
    """Tokenise a prompt (one user turn of a chat pair's template unless ``raw``) after checking
    it is non-empty and fits the context."""
    check_prompt_text(prompt)
    ids = pair.encode(prompt, raw=raw)
    if not ids:
        raise ValueError("the prompt has no tokens")
    check_fits(pair, len(ids), settings)
    return ids


def decode(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> Iterator[Step]:
    """Yield one ``Step`` per iteration until ``max_new_tokens`` or EOS; never exceeds the budget."""
    check(settings)
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    check_fits(pair, len(prompt_ids), settings)
    if (why := refusal(pair, settings.method)) is not None:
        raise ValueError(why)
    spec = spec_of(settings.method)
    if spec.decoder is not None:
        return spec.decoder(pair, prompt_ids, settings)
    return run_steps(spec.step, pair, prompt_ids, settings)


def refusal(pair: ModelPair, method: str) -> str | None:
    """Why ``method`` cannot run on ``pair`` (a draft that reads the target's features needs a decoder that
    gives it them), or None."""
    spec = spec_of(method)
    if spec.drafts and reads_features(pair) and not spec.feature_draft:
        able = ", ".join(name for name, s in registry().items() if s.drafts and s.feature_draft)
        return (
            f"the {pair.name} pair's draft reads the target's features, which {spec.short} does not give it; "
            f"run it with {able}"
        )
    return None
