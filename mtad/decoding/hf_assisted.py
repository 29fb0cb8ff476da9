"""transformers' own assisted generation (``generate(assistant_model=...)``), traced into Steps.

The baseline a user would otherwise pick: each verification round becomes a ``Step``, so
``mtad.metrics.summarize`` reads it exactly like our own decoders.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from mtad.decoding.spec import MethodSpec
from mtad.decoding.state import PhaseTimer
from mtad.events import Step
from mtad.models.pair import ModelPair, logits_width
from mtad.settings import PARAMS, Settings


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
    draft_spans: list[tuple] = field(default_factory=list)
    target_spans: list[tuple] = field(default_factory=list)


class AssistTracer:
    """Forward hooks on both models and a streamer, splitting HF assisted generation into rounds.

    The draft proposes one token per forward, so a round's draft calls are its candidates, which
    are the last tokens of the target's verification input; the streamer receives each round's
    kept tokens (transformers copies them to the host: the round's one sync). Forwards are timed
    with the engine's ``PhaseTimer``, read when generation has ended, so timing adds no sync.
    """

    def __init__(self, pair: ModelPair) -> None:
        self.timer = PhaseTimer(pair.device)
        self.device = pair.device
        self.rounds = [AssistRound()]
        self._t: object = None
        self._round_start = 0.0
        self._hooks = [
            pair.draft.register_forward_pre_hook(self._draft_pre),
            pair.draft.register_forward_hook(self._draft_post),
            pair.target.register_forward_pre_hook(self._target_pre, with_kwargs=True),
            pair.target.register_forward_hook(self._target_post),
        ]

    def begin(self) -> None:
        """Start the clock of the first round."""
        self._round_start = time.perf_counter()

    def close(self) -> None:
        """Remove the hooks; bill the time after the last round to it; drop an empty trailing round;
        read every forward's seconds (one sync on CUDA, after generation)."""
        for h in self._hooks:
            h.remove()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        if len(self.rounds) > 1 and not self.rounds[-1].target_calls:
            self.rounds.pop()
        self.rounds[-1].seconds += end - self._round_start
        for r in self.rounds:
            r.draft_seconds = self.timer.seconds(r.draft_spans)
            r.target_seconds = self.timer.seconds(r.target_spans)

    def _draft_pre(self, module: torch.nn.Module, args: tuple) -> None:
        self._t = self.timer.mark()

    def _draft_post(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        r = self.rounds[-1]
        r.draft_calls += 1
        r.draft_spans.append((self._t, self.timer.mark()))

    def _target_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        r = self.rounds[-1]
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = r.draft_calls
        if ids is not None and n:
            r.candidates = ids[0, -n:].clone()  # no host sync here: read after generation
        self._t = self.timer.mark()

    def _target_post(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        r = self.rounds[-1]
        r.target_calls += 1
        r.target_spans.append((self._t, self.timer.mark()))

    # the streamer interface of generate(): the prompt first, then each round's kept tokens
    def put(self, value: torch.Tensor) -> None:
        """Close a round when the target has verified it (the first put, the prompt, is skipped)."""
        r = self.rounds[-1]
        if not r.target_calls:
            return
        r.appended = [int(t) for t in value.reshape(-1).tolist()]
        now = time.perf_counter()
        r.seconds = now - self._round_start
        self._round_start = now
        self.rounds.append(AssistRound())

    def end(self) -> None:
        """Nothing to do at the end of generation."""


@dataclass
class AssistTrace:
    """What ``assisted_generate`` saw: the rounds and the target's unwarped T=1 log-probabilities of the
    output after the prompt."""

    rounds: list[AssistRound]
    target_logprobs: list[float]


def kept_drafts(drafts: list[int], appended: list[int]) -> int:
    """Draft tokens among a round's kept tokens: their common prefix. A token the target chose there
    differs from the draft (greedy: a match would have been accepted; sampling: the residual
    max(0, p - q) is 0 at a rejected draft), and an EOS cut keeps only the drafts up to it."""
    n = 0
    while n < min(len(drafts), len(appended)) and drafts[n] == appended[n]:
        n += 1
    return n


def padding_ids(pair: ModelPair) -> list[int]:
    """Token ids beyond the shared vocabulary (output rows one model has and the other lacks, e.g.
    Qwen2.5-0.5B's 151936 vs 7B's 152064): the engine never samples them, nor may transformers."""
    return list(range(pair.vocab_size, max(logits_width(pair.draft), logits_width(pair.target))))


class VocabBridge:
    """While transformers runs assisted generation, make the model with the narrower output layer look as
    wide as the other: its config's vocab size and its logits, padded with -inf. Otherwise transformers
    takes the two sizes for two tokenizers and switches to its different-tokenizer path (which fails
    for one shared tokenizer). ``suppress_tokens`` keeps the padding ids out of the output."""

    def __init__(self, pair: ModelPair) -> None:
        models = (pair.draft, pair.target)
        width = max(logits_width(m) for m in models)
        self._saved = [(m.config.get_text_config(), m.config.get_text_config().vocab_size) for m in models]
        for cfg, _ in self._saved:
            cfg.vocab_size = width
        self._hooks = [m.register_forward_hook(self._pad_to(width)) for m in models if logits_width(m) < width]

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


def generation_config(pair: ModelPair, settings: Settings, draft: bool = False) -> GenerationConfig:
    """A fresh config that sets every field that changes the output distribution, so nothing is inherited
    from the models' own ``generation_config`` (transformers fills every unset field from it: a target that
    ships ``repetition_penalty`` would otherwise decode a different distribution than our decoders).

    The draft's (``draft=True``) also fixes its drafting: exactly gamma tokens per round (constant
    schedule, no confidence early stop), where transformers 5 reads those options."""
    eos = sorted(pair.eos_ids)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    greedy = settings.is_greedy
    extra = padding_ids(pair)
    config = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else settings.temperature,  # greedy: no warper runs, none to set
        top_k=None if greedy else settings.top_k,
        top_p=None if greedy else settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        min_length=0,
        min_new_tokens=0,
        num_beams=1,
        num_return_sequences=1,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        length_penalty=1.0,
        renormalize_logits=False,
        remove_invalid_values=False,
        eos_token_id=eos or None,
        pad_token_id=pad,
        suppress_tokens=extra or None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    if draft:
        config.num_assistant_tokens = settings.gamma
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
    return config


def assisted_generate(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> AssistTrace:
    """transformers' own assisted generation on the pair: ``target.generate(assistant_model=draft)``.

    Both models' ``generation_config`` are replaced by :func:`generation_config` for the call (and
    restored after), so the run follows our settings and nothing else; the target's raw logits of the
    kept tokens come back with the output (``output_logits``), so perplexity needs no extra forward.
    """
    saved = (pair.target.generation_config, pair.draft.generation_config)
    pair.target.generation_config = generation_config(pair, settings)
    pair.draft.generation_config = generation_config(pair, settings, draft=True)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=pair.device)
    torch.manual_seed(settings.seed)
    if pair.device.type == "cuda":
        torch.cuda.manual_seed_all(settings.seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    tracer = AssistTracer(pair)
    bridge = VocabBridge(pair) if padding_ids(pair) else None
    try:
        tracer.begin()
        out = pair.target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=pair.draft,
            generation_config=pair.target.generation_config,
            streamer=tracer,
        )
    finally:
        tracer.close()
        if bridge is not None:
            bridge.close()
        hf_logging.set_verbosity(verbosity)
        pair.target.generation_config, pair.draft.generation_config = saved
    new = out.sequences[0, len(prompt_ids) :]
    lps = []
    if new.numel():
        logits = torch.cat(out.logits, dim=0)[:, : pair.vocab_size].float()
        lps = torch.log_softmax(logits, dim=-1).gather(-1, new[:, None])[:, 0].tolist()
    return AssistTrace(rounds=tracer.rounds, target_logprobs=lps)


def assisted_decode(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> Iterator[Step]:
    """The registry's decoder for ``hf-assisted``: the whole generation, then its rounds as Steps."""
    yield from assisted_steps(pair, assisted_generate(pair, prompt_ids, settings))


def assisted_steps(pair: ModelPair, trace: AssistTrace) -> list[Step]:
    """One Step per round (drafts, accepted count, kept tokens, calls, seconds, the target's
    log-probabilities), so ``summarize`` reads it like any decoder."""
    lps = trace.target_logprobs
    steps, pos = [], 0
    for i, r in enumerate(trace.rounds):
        drafts = [] if r.candidates is None else [int(t) for t in r.candidates.tolist()]
        n = len(r.appended)
        accepted = kept_drafts(drafts, r.appended)
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


SPEC = MethodSpec(
    name="hf-assisted",
    label="Hugging Face assisted generation",
    short="HF assisted",
    colour="#475569",
    params=(PARAMS["gamma"],),
    decoder=assisted_decode,
    exact=True,
    racer=False,  # transformers' own loop: no per-iteration trace for the page
    panel="sd",
)
