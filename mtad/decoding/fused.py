"""An iteration's bookkeeping compiled into a few kernels where a kernel launch costs more than its work.

Between the forwards, an iteration warps distributions, lists top-k tokens, chooses beams and applies its rule:
dozens of operations on a few dozen values each. On a GPU every one is a kernel launch the host pays for,
hundreds an MTAD iteration outside the forwards' graphs, so on the compiled engine ``torch.compile`` fuses
each function marked :func:`fused` into a few kernels there. On a CPU an operation costs its dispatch and
a compiled call costs more than the dozen operations it fuses, so there the same function runs as written.
Both run one Python function: compiled, it takes the general paths that need no host read
(``torch.compiler.is_compiling``).

The functions take the run's temperature, top-p and log τ as 0-d device tensors (``DecodeState.distribution`` and
``log_tau``), so a visitor's new value is an input to the graph already compiled: only turning the
temperature or top-p on or off, or greedy decoding, makes a new one."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch._dynamo

from mtad.models.static_llama import hold_graph_limits

if TYPE_CHECKING:
    from mtad.models.pair import ModelPair

R = TypeVar("R")
log = logging.getLogger(__name__)


def fused_enabled(pair: ModelPair) -> bool:
    """Whether a generation on ``pair`` runs the :func:`fused` functions compiled: on the compiled engine
    (whose warm-up compiles them before anyone waits) on CUDA, unless the operator's ``MTAD_FUSED=0``
    turns it off (to measure what it brings)."""
    return pair.engine == "compiled" and pair.device.type == "cuda" and os.environ.get("MTAD_FUSED", "1") != "0"


class Fused(Generic[R]):
    """A function that runs compiled (``fullgraph``: one graph, no host read) when called with
    ``fuse=True``, as written otherwise. Should compiling it fail (more settings than
    :data:`~mtad.models.static_llama.RECOMPILE_LIMIT` graphs, say), it runs as written from then on: slower, never wrong."""

    def __init__(self, fn: Callable[..., R]) -> None:
        self.eager = fn
        self.compiled = torch.compile(fn, fullgraph=True)
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, fuse: bool = False, **kwargs: Any) -> R:
        if fuse and not self.failed:
            hold_graph_limits()
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.RecompileError:  # the tests' error_on_recompile: not a failure to hide
                raise
            except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
                self.failed = True
                log.warning("%s runs uncompiled from now on: compiling it failed (%s)", self.__name__, exc)
        return self.eager(*args, **kwargs)


def fused(fn: Callable[..., R]) -> Fused[R]:
    """Mark ``fn`` as bookkeeping to compile where launches are dear (:class:`Fused`)."""
    return Fused(fn)
