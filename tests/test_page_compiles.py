"""The page's compiled forwards never fall back to uncompiled ones: the page's own warm-up (a loading thread),
then every racer at the ends of the page's γ, W and m ranges in lane threads, as a visitor's runs do, and
dynamo's own counters show no graph limit hit and no frame left uncompiled."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import smollm2_target

from mtad.decoding import encode_prompt
from mtad.decoding.spec import racers, spec_of
from mtad.models import static_llama
from mtad.settings import PARAMS, Settings
from mtad.ui.runner import LaneWorker, PairCache


def limit_hits() -> int:
    """How often dynamo ran a frame uncompiled for hitting a graph limit, from its own counters."""
    return sum(n for why, n in torch._dynamo.utils.counters["unimplemented"].items() if "recompile limit" in why)


def graphs_per_function() -> dict[str, int]:
    """Graphs dynamo holds for each of the engine's compiled forwards (its cache entries)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {
        f.__name__: len(_debug_get_cache_entry_list(f.__code__))
        for f in (static_llama.forward_part, static_llama.gemv_part)
    }


def page_settings() -> list[Settings]:
    """Every racer (and AR) at the ends of the page's ranges for the settings it uses: γ, W and m from their
    smallest to their largest, short runs."""
    hi = {f: int(PARAMS[f].widget_range[1]) for f in ("gamma", "beams", "num_drafts")}
    out = [Settings(method="ar", max_new_tokens=8)]
    for method in racers():
        uses = spec_of(method).uses
        for gamma in (1, hi["gamma"]):
            for width in (1, hi["beams"] if "beams" in uses else hi["num_drafts"]):
                s = Settings(method=method, gamma=gamma, max_new_tokens=2 * (gamma + 1), seed=1)
                if "beams" in uses:
                    s = s.with_(beams=width)
                elif "num_drafts" in uses:
                    s = s.with_(num_drafts=width)
                elif width > 1:
                    continue
                out.append(s)
    return out


def run_as_the_page_does(name: str) -> None:
    """Load ``name`` as the page's start-up does (its preload thread compiles the pair), then each of
    :func:`page_settings` in a lane thread (its untimed warm-up of the settings' shapes, then the decode)."""
    cache = PairCache(1)
    cache.preload(name).join()
    pair = cache.peek(name)
    assert pair is not None and pair.engine == "compiled"
    ids = encode_prompt(pair, "Say hello to the reader.", Settings())
    for settings in page_settings():
        lane = LaneWorker(pair, ids, settings, threading.Event())
        lane.start()
        lane.join()
        ended = []
        while not lane.events.empty():
            ended.append(lane.events.get())
        assert ended[-1][0] == "end" and ended[-1][1] == "done", (settings, ended[-1])


@pytest.mark.timeout(2700)  # smollm2 compiles every shape the page can ask for: minutes on 2 busy cores
@pytest.mark.parametrize("name", ["embedded", "smollm2"])
def test_the_page_s_warm_up_and_every_racer_at_its_range_ends_stay_compiled(name, monkeypatch) -> None:
    if name == "smollm2":
        smollm2_target()
    monkeypatch.setenv("MTAD_ENGINE", "compiled")
    torch._dynamo.reset()
    static_llama.UNCOMPILED.clear()
    hits, declined = limit_hits(), static_llama.frames_declined()
    run_as_the_page_does(name)
    assert limit_hits() == hits
    assert static_llama.frames_declined() == declined
    assert static_llama.UNCOMPILED == {}
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0  # the compiled path ran
    graphs = graphs_per_function()
    print(f"graphs per compiled forward after the page's shapes of {name}: {graphs}")
    # a page holding two pairs (MTAD_MAX_LOADED_PAIRS=2) compiles both pairs' shapes into the same functions
    assert max(graphs.values()) <= static_llama.RECOMPILE_LIMIT // 2, graphs


def test_a_forward_dynamo_declines_is_named_with_its_shape(tiny_pair, monkeypatch) -> None:
    """The negative control: with dynamo's limit at one graph a function, a forward of a second token count
    runs uncompiled, the counters see it, and the engine names that shape for the status line."""
    from mtad.decoding.static_lm import compile_shapes

    monkeypatch.setattr(static_llama, "RECOMPILE_LIMIT", 1)
    torch._dynamo.reset()
    static_llama.UNCOMPILED.clear()
    declined = static_llama.frames_declined()
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=1):
        compile_shapes(tiny_pair.target, tiny_pair.vocab_size, 3)
    assert static_llama.frames_declined() > declined
    shapes = static_llama.uncompiled_shapes()
    assert shapes and all("1 row" in s and "tokens" in s for s in shapes), shapes
