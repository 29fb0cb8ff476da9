"""A GGUF model, dequantised once into an ordinary transformers directory in the user's cache.

transformers reads a GGUF file far more slowly than the same weights as safetensors (its tensor-name map
is rebuilt per tensor, the file parsed twice, the tokenizer converted in Python). So the first load writes
the dequantised fp32 weights, config and tokenizer to ``$MTAD_CACHE`` (default
``~/.cache/mtad``), keyed by the file's name and the SHA-256 of its bytes; later loads read that.

The key is the content, not the file's modification time (as it was): every install of a packaged GGUF
(a new virtual environment, a clean checkout's CI) writes the file anew, and each made another full copy
of the target that nothing removed. Copies under that old key are removed when the new one is written.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer


def cache_root() -> Path:
    """``$MTAD_CACHE``, else ``$XDG_CACHE_HOME/mtad``, else ``~/.cache/mtad``."""
    if os.environ.get("MTAD_CACHE"):
        return Path(os.environ["MTAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtad"


def cached_dir(gguf: Path) -> Path:
    """Where the dequantised copy of ``gguf`` lives (it may not exist yet): the same bytes under the same
    name, wherever and whenever they were installed, share one copy. Hashing the file costs far less than the
    load it saves."""
    with gguf.open("rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return cache_root() / "gguf" / f"{gguf.stem}-sha256-{digest[:16]}"


def remove_mtime_keyed(gguf: Path) -> list[Path]:
    """Delete the copies of a GGUF of this name that earlier versions keyed by size and modification
    time (``<stem>-<size>-<mtime>``), one per install; the paths removed."""
    legacy = re.compile(rf"{re.escape(gguf.stem)}-\d+-\d+")
    folder = cache_root() / "gguf"
    stale = [p for p in folder.iterdir() if p.is_dir() and legacy.fullmatch(p.name)] if folder.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


PARTIAL = ".partial-"
"""The prefix of a copy being written: ``.partial-<pid>-<random>``, renamed into place once complete."""


def remove_partials(folder: Path) -> list[Path]:
    """Delete the half-written copies in ``folder`` whose writer is gone (killed, or its disk filled up before
    it could clean up); a writer still running keeps its own. The paths removed."""
    stale = []
    for path in folder.glob(f"{PARTIAL}*") if folder.is_dir() else []:
        pid = path.name[len(PARTIAL) :].split("-")[0]
        if not (pid.isdigit() and int(pid) != os.getpid() and alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return stale


def alive(pid: int) -> bool:
    """True when a process of this id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sync_tree(folder: Path) -> None:
    """Flush every file of ``folder``, then the folder itself, to the disk: a copy renamed into place after this
    is whole even after a power cut (a truncated ``model.safetensors`` would otherwise be trusted for ever)."""
    for path in [*sorted(p for p in folder.rglob("*") if p.is_file()), folder]:
        sync(path)


def sync(path: Path) -> None:
    """``fsync`` one file or folder (a folder's entries: a rename in it is then on the disk too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def materialize(gguf: Path) -> Path | None:
    """The cached transformers directory for ``gguf``, written on first use; None when the cache
    cannot be written (read-only home, full disk): the caller then loads the GGUF file directly. A copy is
    written under a ``.partial-*`` name, flushed to disk and renamed into place, so a reader only ever finds a
    whole one; half-written copies left by a writer that died are removed first."""
    out = cached_dir(gguf)
    if (out / "model.safetensors").is_file():
        return out
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_partials(out.parent)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{PARTIAL}{os.getpid()}-"))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config
        config.__dict__.pop("quantization_config", None)  # the weights written here are plain fp32
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        sync_tree(tmp)
        tmp.rename(out)  # atomic: a concurrent or interrupted writer never leaves a half directory
        sync(out.parent)
        remove_mtime_keyed(gguf)
    except Exception:  # noqa: BLE001 - unwritable cache, a full disk (safetensors raises its own error), or another process renamed its copy first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return out if (out / "model.safetensors").is_file() else None
    return out
