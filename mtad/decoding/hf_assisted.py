"""transformers' own assisted generation (``generate(assistant_model=...)``), traced into Steps.

The baseline a user would otherwise pick: each verification round becomes a ``Step``, so
``mtad.metrics.summarize`` reads it exactly like our own decoders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mtad.events import Step
from mtad.pair import ModelPair
from mtad.settings import Settings

HF_DRAFT_OPTIONS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@dataclass
class AssistRound:
    """One verification round of ``generate(assistant_model=...)``: drafts, kept tokens, calls, seconds."""

    candidates: torch.Tensor | None = None
    appended: list[int] = field(default_factory=list)
    draft_calls: int = 0
    target_calls: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    seconds: float = 0.0


class AssistTracer:
    """Forward hooks on both models and a streamer, splitting HF assisted generation into rounds.

    The draft proposes one token per forward, so a round's draft calls are its candidates, which
    are the last tokens of the target's verification input; the streamer receives each round's
    kept tokens. Forwards are timed with the engine's synchronised clock.
    """

    def __init__(self, pair: ModelPair) -> None:
        from mtad.decoding.state import Clock

        self.clock = Clock(pair.device)
        self.rounds = [AssistRound()]
        self._t = 0.0
        self._round_start = 0.0
        self._hooks = [
            pair.draft.register_forward_pre_hook(self._draft_pre),
            pair.draft.register_forward_hook(self._draft_post),
            pair.target.register_forward_pre_hook(self._target_pre, with_kwargs=True),
            pair.target.register_forward_hook(self._target_post),
        ]

    def begin(self) -> None:
        """Start the clock of the first round."""
        self._round_start = self.clock.now()

    def close(self) -> None:
        """Remove the hooks; bill the time after the last round to it; drop an empty trailing round."""
        for h in self._hooks:
            h.remove()
        end = self.clock.now()
        if len(self.rounds) > 1 and not self.rounds[-1].target_calls:
            self.rounds.pop()
        self.rounds[-1].seconds += end - self._round_start

    def _draft_pre(self, module: torch.nn.Module, args: tuple) -> None:
        self._t = self.clock.now()

    def _draft_post(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        r = self.rounds[-1]
        r.draft_calls += 1
        r.draft_seconds += self.clock.now() - self._t

    def _target_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        r = self.rounds[-1]
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = r.draft_calls
        if ids is not None and n:
            r.candidates = ids[0, -n:].clone()  # no host sync here: read after generation
        self._t = self.clock.now()

    def _target_post(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        r = self.rounds[-1]
        r.target_calls += 1
        r.target_seconds += self.clock.now() - self._t

    # the streamer interface of generate(): the prompt first, then each round's kept tokens
    def put(self, value: torch.Tensor) -> None:
        """Close a round when the target has verified it (the first put, the prompt, is skipped)."""
        r = self.rounds[-1]
        if not r.target_calls:
            return
        r.appended = [int(t) for t in value.reshape(-1).tolist()]
        now = self.clock.now()
        r.seconds = now - self._round_start
        self._round_start = now
        self.rounds.append(AssistRound())

    def end(self) -> None:
        """Nothing to do at the end of generation."""


@dataclass
class AssistTrace:
    """What ``assisted_generate`` saw: the rounds and the whole output after the prompt."""

    rounds: list[AssistRound]
    new_ids: list[int]


def _logits_width(model: torch.nn.Module) -> int:
    return model.get_output_embeddings().weight.shape[0]


def padding_ids(pair: ModelPair) -> list[int]:
    """Token ids beyond the shared vocabulary (output rows one model has and the other lacks, e.g.
    Qwen2.5-0.5B's 151936 vs 7B's 152064): the engine never samples them, nor may transformers."""
    return list(range(pair.vocab_size, max(_logits_width(pair.draft), _logits_width(pair.target))))


class VocabBridge:
    """While transformers runs assisted generation, make the model with the narrower output layer look as
    wide as the other: its config's vocab size and its logits, padded with -inf. Otherwise transformers
    takes the two sizes for two tokenizers and switches to its different-tokenizer path (which fails
    for one shared tokenizer). ``suppress_tokens`` keeps the padding ids out of the output."""

    def __init__(self, pair: ModelPair) -> None:
        models = (pair.draft, pair.target)
        width = max(_logits_width(m) for m in models)
        self._saved = [(m.config.get_text_config(), m.config.get_text_config().vocab_size) for m in models]
        for cfg, _ in self._saved:
            cfg.vocab_size = width
        self._hooks = [m.register_forward_hook(self._pad_to(width)) for m in models if _logits_width(m) < width]

    @staticmethod
    def _pad_to(width: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: object) -> object:
            logits = output.logits
            output.logits = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))
            return output

        return hook

    def close(self) -> None:
        """Remove the padding and restore the configs."""
        for h in self._hooks:
            h.remove()
        for cfg, size in self._saved:
            cfg.vocab_size = size


def assisted_generate(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> AssistTrace:
    """transformers' own assisted generation on the pair: ``target.generate(assistant_model=draft)``.

    The draft drafts exactly gamma tokens per round (constant schedule, no confidence early stop,
    options set on the draft's ``generation_config`` where transformers 5 reads them, restored after).
    Sampling follows the run's settings (temperature, top-k, top-p; greedy = no sampling) and
    nothing else from the models' own generation configs (no repetition penalty, no min length).
    """
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    gc = pair.draft.generation_config
    saved = {k: getattr(gc, k, None) for k in HF_DRAFT_OPTIONS}
    gc.num_assistant_tokens = settings.gamma
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    eos = sorted(pair.eos_ids)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    sampling = (
        {}
        if settings.is_greedy
        else {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p}
    )
    extra = padding_ids(pair)
    config = GenerationConfig(
        do_sample=not settings.is_greedy,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=pad,
        suppress_tokens=extra or None,
        **sampling,
    )
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=pair.device)
    torch.manual_seed(settings.seed)
    if pair.device.type == "cuda":
        torch.cuda.manual_seed_all(settings.seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    tracer = AssistTracer(pair)
    bridge = VocabBridge(pair) if extra else None
    try:
        tracer.begin()
        out = pair.target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=pair.draft,
            generation_config=config,
            streamer=tracer,
        )
    finally:
        tracer.close()
        if bridge is not None:
            bridge.close()
        hf_logging.set_verbosity(verbosity)
        for k, v in saved.items():
            setattr(gc, k, v)
    return AssistTrace(rounds=tracer.rounds, new_ids=[int(t) for t in out[0, len(prompt_ids) :].tolist()])


@torch.inference_mode()
def target_logprobs(pair: ModelPair, prompt_ids: list[int], new_ids: list[int]) -> list[float]:
    """The target's unwarped T=1 log-probabilities of ``new_ids`` after the prompt, in ONE forward."""
    if not new_ids:
        return []
    ids = torch.tensor([prompt_ids + new_ids], dtype=torch.long, device=pair.device)
    n = len(prompt_ids)
    logits = pair.target(input_ids=ids).logits[0, n - 1 : -1, : pair.vocab_size].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, n:, None])[:, 0].tolist()


def assisted_steps(pair: ModelPair, prompt_ids: list[int], trace: AssistTrace) -> list[Step]:
    """One Step per round (drafts, accepted count, kept tokens, calls, seconds), with the target's
    log-probabilities from one extra, untimed forward, so ``summarize`` reads it like any decoder."""
    lps = target_logprobs(pair, prompt_ids, trace.new_ids)
    rounds = trace.rounds
    if [t for r in rounds for t in r.appended] != trace.new_ids:  # the streamer missed rounds: one lump step
        cands = [r.candidates for r in rounds if r.candidates is not None]
        lump = AssistRound(appended=trace.new_ids, candidates=torch.cat(cands) if cands else None)
        for r in rounds:
            for k in ("draft_calls", "target_calls", "draft_seconds", "target_seconds", "seconds"):
                setattr(lump, k, getattr(lump, k) + getattr(r, k))
        rounds = [lump]
    steps, pos = [], 0
    for i, r in enumerate(rounds):
        drafts = [] if r.candidates is None else [int(t) for t in r.candidates.tolist()]
        n = len(r.appended)
        accepted = min(max(n - r.target_calls, 0), len(drafts)) if len(rounds) == 1 else max(n - 1, 0)
        steps.append(
            Step(
                index=i,
                method="hf-assisted",
                draft_ids=drafts,
                accepted=accepted,
                appended_ids=list(r.appended),
                from_target=[j >= accepted for j in range(n)],
                target_logprobs=lps[pos : pos + n],
                target_calls=r.target_calls,
                draft_calls=r.draft_calls,
                draft_seconds=r.draft_seconds,
                target_seconds=r.target_seconds,
                other_seconds=max(r.seconds - r.draft_seconds - r.target_seconds, 0.0),
                eos=bool(r.appended) and r.appended[-1] in pair.eos_ids,
            )
        )
        pos += n
    return steps
