"""The phase split (draft / target / other seconds) adds up to each iteration's wall time, checked against
clocks of our own: forward hooks on the models and a stopwatch around each ``next()`` of the decoder."""

from __future__ import annotations

import time

import pytest

from mtad.decoding import DECODERS, decode
from mtad.decoding.iteration import TARGET
from mtad.decoding.speculative import SD
from mtad.decoding.state import DecodeState
from mtad.settings import Settings


class ForwardStopwatch:
    """perf_counter around every forward of one model (independent of the engine's timer)."""

    def __init__(self, model):
        self.seconds, self.calls, self._t = 0.0, 0, 0.0
        self._hooks = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._t = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._t
        self.calls += 1

    def take(self):
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def close(self):
        for h in self._hooks:
            h.remove()


@pytest.mark.parametrize("method", list(DECODERS))
def test_phase_split_adds_up_to_the_iteration_wall_time(tiny_pair, method):
    settings = Settings(method=method, gamma=3, beams=2, max_new_tokens=24, seed=1)
    draft, target = ForwardStopwatch(tiny_pair.draft), ForwardStopwatch(tiny_pair.target)
    try:
        it = decode(tiny_pair, tiny_pair.encode("abc de fgh"), settings)
        steps, walls = [], []
        t0 = time.perf_counter()
        for step in it:
            walls.append(time.perf_counter() - t0)
            steps.append((step, draft.take(), target.take()))
            t0 = time.perf_counter()
    finally:
        draft.close()
        target.close()
    assert steps
    if method == "hf-assisted":  # one generate() call: compare the totals
        total = sum(s.seconds for s, _, _ in steps)
        assert 0 < total <= walls[0] and total >= 0.8 * walls[0] - 0.01
        (d, dc), (t, tc) = steps[0][1], steps[0][2]
        assert sum(s.draft_calls for s, _, _ in steps) == dc and sum(s.target_calls for s, _, _ in steps) == tc
        assert sum(s.draft_seconds for s, _, _ in steps) == pytest.approx(d, rel=0.05, abs=1e-3)
        assert sum(s.target_seconds for s, _, _ in steps) == pytest.approx(t, rel=0.05, abs=1e-3)
        return
    for step, (d, dc), (t, tc) in steps:
        assert (step.draft_calls, step.target_calls) == (dc, tc)
        assert step.draft_seconds >= d and step.target_seconds >= t  # each phase holds its forwards
        assert step.other_seconds >= 0
    for (step, _, _), wall in zip(steps, walls, strict=True):
        assert step.seconds <= wall  # the phases never claim more than the iteration's wall time
    # ... and, summed over the run, add up to it (what is left is this loop's own bookkeeping)
    assert sum(s.seconds for s, _, _ in steps) >= 0.9 * sum(walls) - 0.001 * len(steps)
    # the phases are the forwards plus a little slicing (totals: a busy machine's hiccups average out)
    for phase, hooks in (("draft", 1), ("target", 2)):
        inside = sum(getattr(s, f"{phase}_seconds") for s, *_ in steps)
        forwards = sum(x[hooks][0] for x in steps)
        calls = sum(x[hooks][1] for x in steps)
        assert forwards <= inside <= 1.3 * forwards + 0.001 * calls


@pytest.mark.parametrize("step_fn", [TARGET, SD])
def test_set_up_is_billed_to_the_first_iteration_only(tiny_pair, step_fn):
    """A run's seconds cover all of its work: what happens between ``DecodeState.start`` and the first
    iteration (caches, generator) counts in the first step; later steps hold only their own work."""
    st = DecodeState.start(tiny_pair, tiny_pair.encode("abc de fgh"), Settings(method="sd", gamma=2, seed=1))
    time.sleep(0.5)
    first = step_fn(st)
    time.sleep(0.5)
    second = step_fn(st)
    assert first.seconds >= 0.5
    assert second.seconds < 0.5  # a tiny model's step takes milliseconds
