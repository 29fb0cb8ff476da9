"""The page's inputs: ranges, parsing into ``Settings`` with readable errors, example prompts."""

from __future__ import annotations

import math

from mtad.pair import Preset
from mtad.prompts import PromptFileError, read_prompts
from mtad.settings import Settings

TAU_RANGE = (0.0, 1.0)
BEAMS_RANGE = (1, 16)
GAMMA_RANGE = (1, 12)
MAX_NEW_RANGE = (1, 512)
TOP_K_RANGE = (0, 200)
DRAFTS_RANGE = (1, 8)
DEFAULTS = Settings(max_new_tokens=64)


def as_int(name: str, value: object, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from a widget value (integral floats accepted), else ValueError."""
    if value is None or value == "":
        raise ValueError(f"{name} is empty: give an integer from {lo} to {hi}")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer from {lo} to {hi}; got {value}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer from {lo} to {hi}; got {value!r}") from None
    if not math.isfinite(f) or f != int(f) or not lo <= f <= hi:
        raise ValueError(f"{name} must be an integer from {lo} to {hi}; got {value}")
    return int(f)


def as_float(name: str, value: object) -> float:
    """A finite float from a widget value, else ValueError."""
    if value is None or value == "" or isinstance(value, bool):
        raise ValueError(f"{name} is empty: give a number")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number; got {value!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number; got {value}")
    return f


def parse_settings(
    tau: object,
    beams: object,
    gamma: object,
    max_new_tokens: object,
    greedy: object,
    temperature: object,
    top_k: object,
    top_p: object,
    seed: object,
    num_drafts: object = DEFAULTS.num_drafts,
    tau1: object = DEFAULTS.tau1,
    tau2: object = DEFAULTS.tau2,
) -> Settings:
    """Settings for the run from the widgets' values; ``ValueError`` with a message otherwise.

    The ``method`` is set per lane later; the app's ranges are narrower than the engine's.
    """
    s = Settings(
        method="mtad",
        greedy=bool(greedy),
        temperature=as_float("temperature", temperature),
        top_k=as_int("top-k", top_k, *TOP_K_RANGE),
        top_p=as_float("top-p", top_p),
        gamma=as_int("draft length γ", gamma, *GAMMA_RANGE),
        beams=as_int("beams W", beams, *BEAMS_RANGE),
        tau=as_float("τ", tau),
        draft_mode="beam",
        max_new_tokens=as_int("max new tokens", max_new_tokens, *MAX_NEW_RANGE),
        seed=as_int("seed", seed, 0, 2**31 - 1),
        num_drafts=as_int("drafts m", num_drafts, *DRAFTS_RANGE),
        tau1=as_float("τ1 (BiLD fallback)", tau1),
        tau2=as_float("τ2 (BiLD rollback)", tau2),
    )
    return s.validate()


def example_prompts(preset: Preset | None, limit: int = 40) -> list[tuple[str, str]]:
    """(label, prompt) pairs from the preset's prompt set (``mtad.prompts``: ours or Spec-Bench's ``turns``,
    lines that are not prompts skipped); [] when there is none or it is unreadable."""
    if preset is None or not preset.prompts:
        return []
    try:
        prompts = read_prompts(preset.prompts, limit, skip_invalid=True)
    except PromptFileError:
        return []
    out = []
    for p in prompts:
        first = p.text.strip().splitlines()[0]
        first = first if len(first) <= 70 else first[:67] + "…"
        out.append((f"[{p.category}] {first}" if p.category else first, p.text))
    return out
