"""Autoregressive decoding: one target forward per token, the speed and perplexity baseline."""

from __future__ import annotations

import torch

from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import DecodeState, to_host
from mtad.events import Step
from mtad.sampling import pick


def ar_step(st: DecodeState) -> Step:
    """Sample (or argmax) one token from the target; also the last step of SD/MTAD runs."""
    t0 = st.begin()
    logits = st.run_target(None)[0]
    tok = pick(st.judged(logits), st.settings, st.generator)
    lp = torch.log_softmax(logits, dim=-1).gather(0, tok.view(1))[0]  # no host read of ``tok``
    tok_i, lp_f = to_host(tok, lp)
    step = Step(index=0, method="ar", from_target=[True], target_logprobs=[lp_f])
    return st.finish(t0, step, [tok_i], 0)


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
