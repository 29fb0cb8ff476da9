"""The page's inputs: ranges, parsing into ``Settings`` with readable errors, example prompts."""

from __future__ import annotations

import math

from mtad.decoding.spec import check
from mtad.models.presets import Preset
from mtad.prompts import PromptFileError, read_prompts
from mtad.settings import PARAMS, Settings

MAX_NEW_RANGE = (1, 512)
TOP_K_RANGE = (0, 200)
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.0, 1.0)  # open at 0
SEED_RANGE = (0, 2**31 - 1)
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


def as_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> float:
    """A number in [lo, hi] (or (lo, hi] when ``lo_open``) from a widget value, else ValueError saying so."""
    allowed = f"a number {'above' if lo_open else 'from'} {lo:g} {'and at most' if lo_open else 'to'} {hi:g}"
    if value is None or value == "" or isinstance(value, bool):
        raise ValueError(f"{name} is empty: give {allowed}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {allowed}; got {value!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number: {allowed}; got {value}")
    if f > hi or f < lo or (lo_open and f == lo):
        raise ValueError(f"{name} must be {allowed}; got {value}")
    return f


def as_bool(name: str, value: object) -> bool:
    """A checkbox value: true or false (the API may send anything)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {value!r}")
    return value


def page_setting(field: str, value: object) -> int | float:
    """A method setting from its widget, checked against the page's range for it (``Param.widget_range``:
    the engine's, or the narrower span the page offers) and named by its widget label."""
    p = PARAMS[field]
    lo, hi = p.widget_range
    return as_int(p.page_name, value, lo, hi) if p.kind is int else as_float(p.page_name, value, lo, hi)


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
    """Settings for the run from the widgets' values; ``ValueError`` naming the field and what it allows.

    Nothing is clamped: a value out of range is refused, never silently moved into it. The ``method``
    is set per lane later; the app's ranges are narrower than the engine's.
    """
    s = Settings(
        method="mtad",
        greedy=as_bool("greedy", greedy),
        temperature=as_float("temperature", temperature, *TEMPERATURE_RANGE),
        top_k=as_int("top-k", top_k, *TOP_K_RANGE),
        top_p=as_float("top-p", top_p, *TOP_P_RANGE, lo_open=True),
        gamma=page_setting("gamma", gamma),
        beams=page_setting("beams", beams),
        tau=page_setting("tau", tau),
        draft_mode="beam",
        max_new_tokens=as_int("max new tokens", max_new_tokens, *MAX_NEW_RANGE),
        seed=as_int("seed", seed, *SEED_RANGE),
        num_drafts=page_setting("num_drafts", num_drafts),
        tau1=page_setting("tau1", tau1),
        tau2=page_setting("tau2", tau2),
    )
    return check(s)


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
