"""mtad: multi-token assisted decoding, beside speculative decoding and the paper's other decoders.

The Python API, in the order a program uses it::

    import mtad

    pair = mtad.load_pair("embedded")                     # a preset; mtad.load(draft, target) for your own
    settings = mtad.Settings(method="mtad", gamma=4, beams=8, tau=0.1, max_new_tokens=32, seed=0)
    run = mtad.generate(pair, "def fibonacci(n):", settings)
    print(run.text, mtad.summarize(run.steps).tokens_per_second)

``decode`` yields one :class:`Step` per iteration (what was drafted, how it was judged, what was appended)
for a prompt already tokenised, ``generate`` collects them into a :class:`Run` with its text, and
``summarize`` turns Steps into metrics (speed, block efficiency, acceptance, perplexity). ``register`` adds a
decoder (docs/extending.md). Names are imported on first use, so ``import mtad`` loads neither torch nor
transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time the names load lazily below
    from mtad.decoding import DECODERS, decode, encode_prompt, generate
    from mtad.decoding.spec import MethodSpec, register
    from mtad.events import Run, Step
    from mtad.metrics import Metrics, Pooled, pool, speedup, summarize
    from mtad.models.errors import PairError
    from mtad.models.pair import ModelPair, load, load_pair
    from mtad.models.presets import presets
    from mtad.settings import Settings

_EXPORTS = {
    "load_pair": "mtad.models.pair",
    "load": "mtad.models.pair",
    "ModelPair": "mtad.models.pair",
    "PairError": "mtad.models.errors",
    "presets": "mtad.models.presets",
    "Settings": "mtad.settings",
    "decode": "mtad.decoding",
    "generate": "mtad.decoding",
    "encode_prompt": "mtad.decoding",
    "DECODERS": "mtad.decoding",
    "register": "mtad.decoding.spec",
    "MethodSpec": "mtad.decoding.spec",
    "Step": "mtad.events",
    "Run": "mtad.events",
    "summarize": "mtad.metrics",
    "Metrics": "mtad.metrics",
    "pool": "mtad.metrics",
    "Pooled": "mtad.metrics",
    "speedup": "mtad.metrics",
}
"""Each public name and the module that defines it."""

__all__ = [
    "DECODERS",
    "MethodSpec",
    "Metrics",
    "ModelPair",
    "PairError",
    "Pooled",
    "Run",
    "Settings",
    "Step",
    "decode",
    "encode_prompt",
    "generate",
    "load",
    "load_pair",
    "pool",
    "presets",
    "register",
    "speedup",
    "summarize",
]


def __getattr__(name: str) -> Any:  # noqa: ANN401  (any of the exports)
    """Import a public name from its module the first time it is asked for."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mtad' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
