"""The page's choices and facts: the pair and example pickers, the two racing decoders, and what the
server decodes on."""

from __future__ import annotations

from html import escape

import gradio as gr
import torch
import transformers

from mtad.decoding.context_bias import described
from mtad.decoding.spec import racers
from mtad.decoding.static_lm import compiles_draft
from mtad.metrics import versus_weight_read_bound, weight_read_text
from mtad.models.bandwidth import read_bandwidth, weight_bytes
from mtad.models.devices import configure_cpu_threads, resolve_device
from mtad.models.presets import default_pair_name, presets
from mtad.models.static_llama import uncompiled_shapes
from mtad.ui import availability
from mtad.ui.inputs import example_prompts
from mtad.ui.record import LABELS, RunRecord
from mtad.ui.state import PAGE

DEFAULT_RACE = ("sd", "mtad")  # the two lanes' methods, in page order, until the visitor picks others


def pair_choices() -> list[tuple[str, str]]:
    """(label, name) for the pair dropdown: the operator's presets, those that cannot run here marked
    (or hidden, when ``MTAD_UNAVAILABLE_PAIRS=hide``; never all of them)."""
    out, hidden = [], []
    for name, p in presets().items():
        reason = availability.unavailable_reason(p)
        if reason:
            short = "needs the internet" if "internet" in reason else "needs a GPU"
            (hidden if availability.hide_unavailable() else out).append((f"{name} ({short}: not on this server)", name))
        else:
            out.append((name + (" (Hub)" if p.needs_hub else ""), name))
    return out or hidden


def default_pair() -> str:
    """``MTAD_PAIR`` if it names a preset, else ``embedded``, else the first preset."""
    table = presets()
    name = default_pair_name()
    return name if name in table else ("embedded" if "embedded" in table else next(iter(table), ""))


def pair_info(name: str) -> str:
    """The preset's description, whether it needs the Hub, and why it cannot run here if it cannot."""
    p = presets().get(name)
    if p is None:
        return ""
    reason = availability.unavailable_reason(p)
    if reason:
        return f"{escape(p.description)}. **Cannot run on this server:** it {escape(reason)}."
    hub = " Needs the Hugging Face Hub the first time." if p.needs_hub else ""
    when = "when the server starts" if name in PAGE.preloaded else "on its first run"
    return f"{escape(p.description)}.{hub} Loads once, {when}, then stays in memory."


def pair_examples(name: str | None) -> list[tuple[str, str]]:
    """The preset's example prompts, one per label (prompt sets repeat first lines, e.g. many ``def f():``)."""
    seen, out = set(), []
    for label, text in example_prompts(presets().get(name)):
        if label not in seen:
            seen.add(label)
            out.append((label, text))
    return out


def examples_update(name: str, value: str | None) -> dict:
    """The example-prompt dropdown for a preset, ``value`` picked (empty, with a note, when it has none)."""
    ex = pair_examples(name)
    label = "Example prompts" if ex else "Example prompts (none for this pair)"
    return gr.update(choices=ex, value=value, label=label, interactive=bool(ex))


def on_pair_change(name: str, prompt: str | None) -> tuple[str, dict, dict]:
    """A new pair: its description and examples; the prompt follows only if the visitor had not typed one."""
    ex = pair_examples(name)
    typed = bool(prompt and prompt.strip()) and not any(
        prompt == text for other in presets() for _, text in pair_examples(other)
    )
    if typed or not ex:
        return pair_info(name), examples_update(name, None), gr.skip()
    return pair_info(name), examples_update(name, ex[0][1]), gr.update(value=ex[0][1])


def on_example(prompt: str | None) -> dict:
    """An example picked: it becomes the prompt (nothing changes when the pick was cleared)."""
    return gr.update(value=prompt) if prompt else gr.skip()


def racer_choices() -> list[tuple[str, str]]:
    """The lane dropdowns' (label, method) choices: every registered method its spec offers as a racer."""
    return [(LABELS[m], m) for m in racers()]


def __getattr__(name: str) -> tuple[str, ...]:
    """``RACERS``: the decoders a visitor may race against each other (the AR lane is the optional third),
    read from the registry when asked for."""
    if name == "RACERS":
        return racers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pick_racers(left: object, right: object) -> list[str]:
    """The two decoders to race, checked: known, and not the same one twice."""
    for side, m in (("left", left), ("right", right)):
        if m not in racers():
            raise ValueError(f"the {side} lane must be one of {', '.join(racers())}; got {m!r}")
    if left == right:
        raise ValueError(f"both lanes are {LABELS[left]}: pick two different decoders to race")
    return [str(left), str(right)]


def shown_race(left: object, right: object) -> tuple[str, str]:
    """The two lanes to title before a run: the visitor's picks, or the default race while they cannot run
    (the run itself refuses them with a message)."""
    try:
        first, second = pick_racers(left, right)
    except ValueError:
        return DEFAULT_RACE
    return first, second


def server_device() -> str:
    """What this server decodes on, in words, for the page header."""
    dev = resolve_device("auto")
    if dev.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(dev)}"
    configure_cpu_threads()  # what loading a pair will set: the header must say what runs
    return f"{cpu_label()}, no GPU"


def device_text(record: RunRecord, running: bool = False) -> str:
    """The status line's facts about a run (``running``: still going): the device, the pair and, read from
    the loaded models (the page's one home for them), parameter counts, dtype and engine, and any shape the
    compiled engine ran uncompiled."""
    pair = PAGE.pairs.peek(record.pair)
    facts = f" · {pair_facts(pair)}" if pair is not None else ""
    return f"{'Running' if running else 'Ran'} on **{escape(record.device)}** · pair `{record.pair}`{facts}"


def uncompiled_text() -> str:
    """Which forward shapes dynamo declined to compile in this process (they run uncompiled, slower), for the
    status line; empty when none did."""
    shapes = uncompiled_shapes()
    if not shapes:
        return ""
    return f" · **uncompiled forwards** (slower than compiled): {escape('; '.join(shapes))}"


def bound_text(record: RunRecord) -> str:
    """The status line's AR lane against the hardware's limit (``mtad.metrics.versus_weight_read_bound``):
    empty until the AR lane has finished."""
    pair = PAGE.pairs.peek(record.pair)
    ar = next((lane for lane in record.lanes.values() if lane.method == "ar" and lane.finished and lane.steps), None)
    if pair is None or ar is None:
        return ""
    weights, rate = weight_bytes(pair.target), read_bandwidth(pair.device)
    times = versus_weight_read_bound(ar.metrics(), weights / rate)
    return f" · {weight_read_text(times, weights, rate)}" if times is not None else ""


def pair_facts(pair: object) -> str:
    """Parameter counts, dtype and engine of a loaded pair, computed from the models themselves, and the
    draft's context n-gram bias where it has one."""
    d, t = pair.parameters()
    dtype = str(pair.dtype).removeprefix("torch.")
    attention = getattr(pair.target.config, "_attn_implementation", None) or "eager"
    engine = f"transformers {transformers.__version__}, {attention} attention"
    if pair.engine == "compiled":
        inductor = f"torch {torch.__version__.split('+')[0]} inductor"
        if compiles_draft(pair):
            engine = f"compiled target and draft ({inductor})"
        else:
            engine = f"compiled target ({inductor}), {engine} for the draft"
    facts = f"draft {millions(d)}, target {millions(t)} parameters · {dtype} · {escape(engine)}"
    facts += uncompiled_text() if pair.engine == "compiled" else ""
    bias = described(pair.draft)
    if bias["weights"]:  # the draft's distribution includes it: what the verify panel's q shows
        where = "every decoder's" if bias["decoders"] == "all drafting" else "the exact decoders'"
        weights = ", ".join(f"{w:g}" for w in bias["weights"])
        facts += f" · {where} draft copies from the context (n-gram weights {weights})"
    return facts


def millions(n: int) -> str:
    """A parameter count to three significant figures: 11.8 M, 135 M, 1.34 B, 250 k."""
    if n >= 1e9:
        return f"{n / 1e9:.3g} B"
    return f"{n / 1e6:.3g} M" if n >= 1e6 else f"{n / 1e3:.3g} k"


def device_name(dev: torch.device) -> str:
    """A run's device as its record names it: the GPU's model, or the CPU with its thread count."""
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return cpu_label()


def cpu_label() -> str:
    """The CPU with the torch threads it decodes on."""
    n = torch.get_num_threads()
    return f"CPU ({n} thread{'s' if n != 1 else ''})"
