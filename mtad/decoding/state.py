"""Shared machinery of every decoder: KV-cached models, the token buffer, the clock."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from mtad.events import Step
from mtad.pair import ModelPair
from mtad.sampling import log_probs, make_generator
from mtad.settings import Settings


class CachedLM:
    """A causal LM with a KV cache that is never re-encoded, only extended and cropped."""

    def __init__(self, model: torch.nn.Module, vocab: int) -> None:
        self.model = model
        self.vocab = vocab
        self.cache = DynamicCache(config=model.config)
        self.calls = 0
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Run ``tokens`` [B, n] after the cached context; fp32 logits of the last ``keep`` positions."""
        kwargs = {"logits_to_keep": keep} if self._keep else {}
        out = self.model(input_ids=tokens, past_key_values=self.cache, use_cache=True, **kwargs)
        self.calls += 1
        return out.logits[:, -keep:, : self.vocab].float()

    def rollback(self, length: int) -> None:
        """Forget cached positions beyond ``length`` (transformers 5: crop takes minus the count)."""
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)


class Clock:
    """Wall time with the device synchronised, so CUDA work is billed to the phase that ran it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class DecodeState:
    """Everything one generation carries between iterations."""

    settings: Settings
    ids: list[int]
    prompt_len: int
    target: CachedLM
    draft: CachedLM | None
    device: torch.device
    eos_ids: frozenset[int]
    generator: torch.Generator
    clock: Clock
    steps_done: int = 0
    draft_seconds: float = field(default=0.0)
    target_seconds: float = field(default=0.0)

    @classmethod
    def start(cls, pair: ModelPair, prompt_ids: list[int], settings: Settings) -> DecodeState:
        """Fresh caches, buffer, generator and clock for one generation."""
        needs_draft = settings.method != "ar"
        return cls(
            settings=settings,
            ids=list(prompt_ids),
            prompt_len=len(prompt_ids),
            target=CachedLM(pair.target, pair.vocab_size),
            draft=CachedLM(pair.draft, pair.vocab_size) if needs_draft else None,
            device=pair.device,
            eos_ids=pair.eos_ids,
            generator=make_generator(pair.device, settings.seed),
            clock=Clock(pair.device),
        )

    @property
    def remaining(self) -> int:
        return self.settings.max_new_tokens - (len(self.ids) - self.prompt_len)

    def draft_length(self) -> int:
        """Draft at most gamma, and never more than leaves room for the target's own token."""
        return min(self.settings.gamma, self.remaining - 1)

    def pending(self, lm: CachedLM) -> torch.Tensor:
        """The tokens ``lm`` has not seen yet, as a [1, n] tensor."""
        return torch.tensor([self.ids[lm.length :]], dtype=torch.long, device=self.device)

    def run_target(self, draft: torch.Tensor | None) -> torch.Tensor:
        """One target forward over the unseen context plus ``draft`` [g]; logits [g+1, V]."""
        tokens = self.pending(self.target)
        g = 0 if draft is None else draft.numel()
        if g:
            tokens = torch.cat([tokens, draft.view(1, -1)], dim=1)
        t0 = self.clock.now()
        logits = self.target.feed(tokens, keep=g + 1)[0]
        self.target_seconds += self.clock.now() - t0
        return logits

    def run_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """One draft forward over ``tokens`` [B, n]; the last position's logits [B, V]."""
        t0 = self.clock.now()
        logits = self.draft.feed(tokens, keep=1)[:, -1]
        self.draft_seconds += self.clock.now() - t0
        return logits

    def judged(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities under the run's own (warped or greedy T=1) distribution."""
        return log_probs(logits, self.settings)

    def commit(self, appended: list[int], accepted_in_cache: int) -> list[int]:
        """Append tokens (cut after EOS), and crop both caches to the kept context."""
        for i, t in enumerate(appended):
            if t in self.eos_ids:
                appended = appended[: i + 1]
                break
        base = len(self.ids)
        self.target.rollback(base + accepted_in_cache)
        if self.draft is not None:
            self.draft.rollback(base + accepted_in_cache)
        self.ids.extend(appended)
        return appended

    def begin(self) -> float:
        """Start an iteration's clock and its per-phase counters."""
        self.draft_seconds = self.target_seconds = 0.0
        return self.clock.now()

    def finish(self, t0: float, step: Step, proposed: list[int], accepted_in_cache: int) -> Step:
        """Commit ``proposed`` (accepted drafts + target token), trim the trace to what was kept
        after an EOS cut, and stamp the step's index, method and phase times."""
        kept = self.commit(proposed, accepted_in_cache)
        step.appended_ids = kept
        step.accepted = min(step.accepted, len(kept))  # an EOS inside the accepted drafts ends the kept ones
        step.from_target = step.from_target[: len(kept)]
        step.target_logprobs = step.target_logprobs[: len(kept)]
        step.eos = kept[-1] in self.eos_ids
        step.index = self.steps_done
        step.method = self.settings.method
        step.target_calls = 1
        step.draft_seconds = self.draft_seconds
        step.target_seconds = self.target_seconds
        step.other_seconds = self.clock.now() - t0 - self.draft_seconds - self.target_seconds
        self.steps_done += 1
        return step


def to_host(*tensors: torch.Tensor | None) -> list:
    """Copy several device tensors to Python lists in ONE host sync per iteration."""
    present = [t for t in tensors if t is not None]
    flat = torch.cat([t.reshape(-1).double() for t in present]).tolist() if present else []
    out, i = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        n = t.numel()
        vals = flat[i : i + n]
        i += n
        if not t.is_floating_point():
            vals = [int(v) for v in vals]
        out.append(vals[0] if t.dim() == 0 else vals)
    return out
