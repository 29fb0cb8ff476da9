"""Autoregressive decoding: one target forward per token, the speed and perplexity baseline."""

from __future__ import annotations

from mtad.decoding.iteration import TARGET
from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState
from mtad.events import Step


def ar_step(st: DecodeState) -> Step:
    """Sample (or argmax) one token from the target; also the last step of SD/MTAD runs."""
    return TARGET(st)


SPEC = MethodSpec(
    name="ar",
    label="Autoregressive (baseline)",
    short="AR",
    colour="#6b7280",
    step=ar_step,
    exact=True,
    drafts=False,
    racer=False,  # the page's optional third lane, not a racer
    panel="none",
)
"""The target alone, one token per forward: the baseline every speed-up is measured against."""
