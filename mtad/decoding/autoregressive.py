"""Autoregressive decoding: one target forward per token, the speed and perplexity baseline."""

from __future__ import annotations

from mtad.decoding.iteration import TARGET
from mtad.decoding.spec import MethodSpec

SPEC = MethodSpec(
    name="ar",
    label="Autoregressive (baseline)",
    short="AR",
    colour="#6b7280",
    step=TARGET,
    exact=True,
    drafts=False,
    racer=False,  # the page's optional third lane, not a racer
    panel="none",
)
"""The target alone, one token per forward: the baseline every speed-up is measured against."""
