"""Which presets can run on this server: Hub pairs need the internet (or a filled cache), big targets a GPU.

The page marks (or, by operator choice, hides) the presets that cannot run here. Every check is
cheap and none blocks the page: the one network probe runs once, in a background thread, with a
timeout; until it answers, Hub pairs are only marked as needing the Hub.

Operator settings (environment):
``MTAD_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) declares that this server has no internet (no probe);
``MTAD_UNAVAILABLE_PAIRS=mark|hide`` marks (default) or hides presets that cannot run here.
"""

from __future__ import annotations

import os
import re
import threading

import torch

from mtad.models.pair import _hub_unreachable
from mtad.models.presets import Preset

GPU_TARGET_BILLIONS = 3.0  # a target this large is too slow (or too big) for a CPU server
_PROBE: dict[str, str | None] = {}
_PROBE_LOCK = threading.Lock()


def offline_setting() -> str | None:
    """Why the operator says there is no internet, or None."""
    if os.environ.get("MTAD_OFFLINE", "").strip().lower() in ("1", "true", "yes"):
        return "MTAD_OFFLINE is set"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    return None


def hide_unavailable() -> bool:
    """The operator's choice: hide presets that cannot run here instead of marking them."""
    return os.environ.get("MTAD_UNAVAILABLE_PAIRS", "mark").strip().lower() == "hide"


def start_hub_probe(timeout: float = 2.0) -> None:
    """Probe the Hub once, in a daemon thread (a slow DNS answer never holds the page up)."""
    with _PROBE_LOCK:
        if "started" in _PROBE or offline_setting():
            return
        _PROBE["started"] = None

    def probe() -> None:
        _PROBE["reason"] = _hub_unreachable(timeout=timeout) or ""

    threading.Thread(target=probe, daemon=True, name="mtad-hub-probe").start()


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached, if known by now (operator setting or finished probe), else None."""
    return offline_setting() or _PROBE.get("reason") or None


def cached(repo_id: str) -> bool:
    """True when the Hub model's config is in the local cache (a file-system look-up, no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a broken cache is a missing cache
        return False


def target_billions(preset: Preset) -> float | None:
    """The target's size in billions of parameters, read from its name ("opt-13b", "Qwen2.5-7B"), if it says."""
    m = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)b(?![a-z])", preset.target.rsplit("/", 1)[-1].lower())
    return float(m.group(1)) if m else None


def unavailable_reason(preset: Preset) -> str | None:
    """Why this preset cannot run on this server, in words, or None when it can (as far as is known)."""
    if preset.needs_hub and not (cached(preset.draft) and cached(preset.target)):
        reason = hub_unreachable()
        if reason:
            return f"needs the internet to fetch its models from the Hugging Face Hub ({reason})"
    size = target_billions(preset)
    if size is not None and size >= GPU_TARGET_BILLIONS and not torch.cuda.is_available():
        return f"needs a GPU: its target has {size:g} B parameters and this server has none"
    return None
