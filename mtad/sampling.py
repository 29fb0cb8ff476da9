"""Logit warping (temperature, then top-k, then top-p) and seeded sampling."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mtad.settings import Settings


def warper(settings: Settings) -> LogitsProcessorList:
    """transformers' own warpers in the paper's order: temperature, top-k, top-p."""
    procs = LogitsProcessorList()
    if settings.is_greedy:
        return procs
    if settings.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k > 0:
        procs.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        procs.append(TopPLogitsWarper(settings.top_p))
    return procs


def log_probs(logits: torch.Tensor, settings: Settings) -> torch.Tensor:
    """Log-probabilities the run samples from and judges with, over the last dim.

    Sampling: log softmax of the warped logits (filtered tokens get -inf). Greedy: the plain
    log softmax at T=1, which is what the paper's rule compares when nothing is sampled.
    """
    logits = logits.float()
    procs = warper(settings)
    if procs:
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1])
        flat = procs(None, flat)
        logits = flat.reshape(shape)
    return torch.log_softmax(logits, dim=-1)


def pick(logp: torch.Tensor, settings: Settings, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: argmax when greedy, else a draw from exp(logp)."""
    if settings.is_greedy:
        return logp.argmax(dim=-1)
    return sample(logp.exp(), generator)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from (unnormalised, non-negative) ``probs``."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def make_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on the model's device so draws are reproducible from ``seed``."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen
