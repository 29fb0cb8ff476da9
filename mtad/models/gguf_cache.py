"""A GGUF model, dequantised once into an ordinary transformers directory in the user's cache.

transformers reads a GGUF file slowly (its tensor-name map is rebuilt per tensor, the file parsed
twice, the tokenizer converted in Python), an order of magnitude slower than the same weights as
safetensors. So the first load
writes the dequantised fp32 weights, config and tokenizer to ``$MTAD_CACHE`` (default
``~/.cache/mtad``), keyed by the file's name, size and modification time; later loads read that.
"""

from __future__ import annotations

import os
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
    """Where the dequantised copy of ``gguf`` lives (it may not exist yet)."""
    st = gguf.stat()
    return cache_root() / "gguf" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"


def materialize(gguf: Path) -> Path | None:
    """The cached transformers directory for ``gguf``, written on first use; None when the cache
    cannot be written (read-only home, full disk): the caller then loads the GGUF file directly."""
    out = cached_dir(gguf)
    if (out / "model.safetensors").is_file():
        return out
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".partial-"))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config
        config.__dict__.pop("quantization_config", None)  # the weights written here are plain fp32
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        tmp.rename(out)  # atomic: a concurrent or interrupted writer never leaves a half directory
    except OSError:  # unwritable cache, or another process renamed its copy first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return out if (out / "model.safetensors").is_file() else None
    return out
