"""On-policy distillation of the ``smollm2`` draft, matched to how it is decoded (DistillSpec).

DistillSpec (Zhou et al., ICLR 2024) trains a draft on **its own samples**, labelled by the target,
with a divergence that is the decoder's acceptance: speculative sampling accepts a draft token with
probability sum_x min(p_w(x), q_w(x)) = 1 - TV(p_w, q_w), where p_w and q_w are the *warped* laws the
run samples from (T 1, top-k 20, top-p 0.9). The loss here is that total variation plus a weight of
forward KL to the target's raw top-32 law: the KL is what greedy decoding needs (argmax agreement) and
it keeps pushing mass onto tokens that the draft's own warping has cut off, where the TV term has no
gradient.

Each round the current draft samples replies to a batch of instructions (never the benchmark's
prompts) — or, in a share of rounds, the target does, so the draft also sees the text it will be
asked to continue at run time — the target labels every reply position in one forward, and the trainer takes a few steps on
a small replay buffer of recent rounds. Weights are chosen by held-out **acceptance**, computed
exactly from p_w and q_w per position on the target's own replies to held-out instructions (the
contexts speculative decoding meets, since its output follows the target), not by loss; every improvement is exported to ``<work>/best`` and ``--stage export`` copies it into
``assets/models/smollm2-draft`` with its figures.

Usage::

    python -m training.onpolicy --stage train --minutes 150   # resumes <work>/state.pt, else the committed draft
    python -m training.onpolicy --stage export                # <work>/best -> assets/models/smollm2-draft
    python -m training.onpolicy --stage evaluate              # the committed draft and <work>/best, held out

A structural option: ``--grow N`` appends N decoder layers to the committed draft, copies of the
target's next layers whose output projections start at zero, so the grown draft starts as exactly the
committed one (:func:`grow`); ``--train-new-only`` freezes every committed parameter and trains the new
layers alone, so nothing that converged drifts under a fresh optimiser.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

WORK = Path(".train-onpolicy")
DRAFT = Path("assets/models/smollm2-draft")
TOPK = 32
SEED = 20261124
WARP = {"temperature": 1.0, "top_k": 20, "top_p": 0.9}  # the paper's sampling, as the app draws


def warping() -> Any:
    """The run settings whose warping the loss matches (the app's and the bench's sampling)."""
    from mtad.settings import Settings

    return Settings(method="ar", **WARP)


# --------------------------------------------------------------------------- the loss


def warped_probs(logits: torch.Tensor) -> torch.Tensor:
    """p_w: probabilities of the warped law the decoders sample from, over the last dim
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
    their raw log-probabilities (forward KL) and their warped probabilities (TV; the warped law's
    support, 20 tokens and ties, lies inside the top 32)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = lp.topk(min(TOPK, lp.shape[-1]), dim=-1)
    pw = warped_probs(logits).gather(-1, idx)
    return {"idx": idx.int(), "lp": vals.half(), "pw": pw.half()}


def draft_terms(
    logits: torch.Tensor, row_of: torch.Tensor, idx: torch.Tensor, lp: torch.Tensor, pw: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-position acceptance, forward KL and cross-entropy from the target's raw top-32 law
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
    """``tv_weight`` x the mean total variation of the warped laws (1 - acceptance) plus ``kl_weight`` x
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


def save_draft(draft: Any, tok: Any, out: Path) -> None:
    """Export as the pair loads it: bf16 embedding and norms, int8 decoder layers, the tokenizer."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(draft).eval().to(torch.bfloat16).quantize_layers()
    model.save_pretrained(out)
    tok.save_pretrained(out)


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


@torch.inference_mode()
def sample_replies(draft: Any, tok: Any, prompts: list[str], seed: int, max_new: int) -> list[dict]:
    """The draft's own replies, sampled as the app samples (its shortlist logits, warped), in the chat
    trainer's batched loop; each sample holds the chat-formatted ids and where the reply starts."""
    from mtad.sampling import log_probs, pick
    from training.chat_draft import batched_replies

    settings = warping()
    columns = draft.columns

    def step(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, None]:
        return columns[pick(log_probs(logits, settings), settings, generator)], None

    was_training = draft.training
    draft.eval()
    prompt_ids, replies, _ = batched_replies(draft, tok, prompts, seed, max_new, step, shortlist_only=True)
    draft.train(was_training)
    return [
        {"ids": torch.cat([prompt, torch.tensor(reply)]).int(), "start": len(prompt) - 1}
        for prompt, reply in zip(prompt_ids, replies, strict=True)
    ]


def target_replies(target: Any, tok: Any, prompts: list[str], seed: int, max_new: int) -> list[dict]:
    """The target's own sampled replies (the chat trainer's batched loop), as ids and reply start."""
    from training.chat_draft import generate_batch

    return [{"ids": s["ids"], "start": s["start"]} for s in generate_batch(target, tok, prompts, seed, max_new)]


@torch.inference_mode()
def label_samples(target: Any, samples: list[dict], chunk: int = 8, features: bool = False) -> list[dict]:
    """The target's labels at every reply position (the position before each reply token), one
    forward per ``chunk`` samples, right-padded; with ``features``, also its last hidden state at every
    position (``"feats"``, bf16: what a feature-reading draft reads)."""
    for i in range(0, len(samples), chunk):
        part = samples[i : i + chunk]
        width = max(len(s["ids"]) for s in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for b, s in enumerate(part):
            ids[b, : len(s["ids"])] = s["ids"].long()
            mask[b, : len(s["ids"])] = 1
        hidden = target.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = target.get_output_embeddings()(hidden)
        for b, s in enumerate(part):
            if features:
                s["feats"] = hidden[b, : len(s["ids"])].to(torch.bfloat16).clone()
            s.update(label(logits[b, s["start"] : len(s["ids"]) - 1]))
    return samples


def batch_terms(draft: Any, samples: list[dict]) -> dict[str, torch.Tensor]:
    """:func:`draft_terms` over every reply position of ``samples``."""
    width = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    rows, cols = [], []
    for b, s in enumerate(samples):
        ids[b, : len(s["ids"])] = s["ids"].long()
        mask[b, : len(s["ids"])] = 1
        c = torch.arange(s["start"], s["start"] + len(s["idx"]))
        rows.append(torch.full_like(c, b))
        cols.append(c)
    rows, cols = torch.cat(rows), torch.cat(cols)
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
    logits = draft.shortlist_logits(hidden[rows, cols])
    cat = {k: torch.cat([s[k] for s in samples]) for k in ("idx", "lp", "pw")}
    return draft_terms(logits, draft.model.embed_tokens.row_of, cat["idx"], cat["lp"], cat["pw"])


@torch.inference_mode()
def evaluate(draft: Any, heldout: list[dict], chunk: int = 8) -> dict[str, float]:
    """Held-out acceptance, top-1 agreement, forward KL and cross-entropy, pooled over every position."""
    was_training = draft.training
    draft.eval()
    sums = {"accept": 0.0, "agree": 0.0, "kl": 0.0, "ce": 0.0}
    n = 0
    for i in range(0, len(heldout), chunk):
        terms = batch_terms(draft, heldout[i : i + chunk])
        for k in sums:
            sums[k] += terms[k].sum().item()
        n += terms["accept"].numel()
    draft.train(was_training)
    return {k: v / max(n, 1) for k, v in sums.items()} | {"positions": n}


# --------------------------------------------------------------------------- the loop


def load_target() -> tuple[Any, Any]:
    """The smollm2 target as the pair runs it on this CPU (its best dtype and kernels), and its tokenizer."""
    from mtad.models.devices import auto_dtype, use_cpu_kernels
    from training.chat_draft import load_target as load

    target, tok = load(auto_dtype(torch.device("cpu")))
    return use_cpu_kernels(target), tok


def train(args: argparse.Namespace) -> None:
    """Rounds of (draft samples, target labels, a few steps), checkpointed every few minutes,
    resumable; exports every held-out improvement in acceptance to ``<work>/best``."""
    torch.set_num_threads(args.threads)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    target, tok = load_target()
    state_path = work / "state.pt"
    saved = torch.load(state_path, weights_only=False) if state_path.exists() else None

    held_path = work / "heldout.pt"
    if held_path.exists():
        heldout = torch.load(held_path, weights_only=False)
    else:  # the target's own replies: the text speculative decoding's contexts follow
        held_prompts = random.Random(SEED).sample(instructions(heldout=True), args.heldout)
        heldout = []
        for i in range(0, len(held_prompts), 16):
            heldout += target_replies(target, tok, held_prompts[i : i + 16], SEED + i, args.max_new)
        label_samples(target, heldout)
        torch.save(heldout, held_path)

    draft = load_draft(DRAFT if saved is None else work / "last")
    log: list[dict] = []
    step, rnd, spent = 0, 0, 0.0
    shape = {"grow": args.grow, "train_new_only": args.train_new_only}
    if saved:
        step, rnd, spent, log = saved["step"], saved["round"], saved["seconds"], saved["log"]
        was = saved.get("shape", {"grow": 0, "train_new_only": False})
        if was != shape:
            sys.exit(f"{work} holds a run with {was}; resume it with the same --grow / --train-new-only")
    elif args.grow:  # the committed draft's score, then the grown one's (the same: the new layers add 0)
        log.append({"step": 0, "round": 0, "seconds": 0.0, "heldout": evaluate(draft, heldout), "committed": True})
        print(f"[onpolicy] committed draft: {log[0]['heldout']}", flush=True)
        grow(draft, target, args.grow, args.grow_from)
    new_layers = list(draft.model.layers)[len(draft.model.layers) - args.grow :] if args.grow else []
    params = train_only(draft, new_layers) if args.train_new_only else list(draft.parameters())
    print(
        f"[onpolicy] draft of {draft.config.num_hidden_layers} layers, training {sum(p.numel() for p in params):,} "
        f"of {sum(p.numel() for p in draft.parameters()):,} parameters",
        flush=True,
    )
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    if saved and saved.get("opt"):
        opt.load_state_dict(saved["opt"])
    if not saved:
        entry = {"step": 0, "round": 0, "seconds": 0.0, "heldout": evaluate(draft, heldout)}
        log.append(entry | ({"grown": args.grow} if args.grow else {"committed": True}))
        print(f"[onpolicy] {'grown' if args.grow else 'committed'} draft: {entry['heldout']}", flush=True)
    best = max(e["heldout"]["accept"] for e in log)

    prompts = instructions(heldout=False)
    random.Random(SEED).shuffle(prompts)
    buffer: list[dict] = []
    rng = random.Random(SEED + step)
    t0, t_save = time.time(), time.time()
    budget = args.minutes * 60
    while (spent + time.time() - t0) < budget:
        # 1. the current draft writes replies; 2. the target labels them
        batch = [prompts[(rnd * args.gen_batch + i) % len(prompts)] for i in range(args.gen_batch)]
        writer = target_replies if rng.random() < args.teacher_share else sample_replies
        fresh = label_samples(
            target, writer(draft if writer is sample_replies else target, tok, batch, SEED + 1000 + rnd, args.max_new)
        )
        rnd += 1
        buffer = (buffer + fresh)[-args.buffer :]
        # 3. a few steps on the recent rounds
        for _ in range(args.steps_per_round):
            progress = (spent + time.time() - t0) / budget
            lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1))))
            for g in opt.param_groups:
                g["lr"] = lr
            terms = batch_terms(draft, rng.sample(buffer, min(args.batch, len(buffer))))
            loss = loss_of(terms, args.kl_weight, args.tv_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
        print(
            f"[onpolicy] round {rnd} step {step} loss {loss.item():.3f} accept {terms['accept'].mean().item():.3f} "
            f"agree {terms['agree'].mean().item():.3f} kl {terms['kl'].mean().item():.3f} lr {lr:.2e}",
            flush=True,
        )
        if rnd % args.eval_every == 0:
            held = evaluate(draft, heldout)
            log.append({"step": step, "round": rnd, "seconds": spent + time.time() - t0, "heldout": held})
            print(f"[onpolicy] heldout {held}", flush=True)
            if held["accept"] > best:
                best = held["accept"]
                save_draft(draft, tok, work / "best")
                (work / "best" / "train_log.json").write_text(json.dumps({"step": step, "log": log}, indent=1))
                print(f"[onpolicy] new best {best:.4f} -> {work / 'best'}", flush=True)
        if time.time() - t_save > 180:
            checkpoint(work, draft, tok, opt, step, rnd, spent + time.time() - t0, log, shape)
            t_save = time.time()
    checkpoint(work, draft, tok, opt, step, rnd, spent + time.time() - t0, log, shape)
    print("[onpolicy] done", flush=True)


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
    """Copy ``<work>/best`` over the committed draft, with the held-out figures that chose it."""
    best = args.work / "best"
    if not (best / "model.safetensors").exists():
        sys.exit(f"nothing to export: {best} holds no weights (no round beat the committed draft yet)")
    log = json.loads((best / "train_log.json").read_text())
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        if (best / name).exists():
            shutil.copy(best / name, DRAFT / name)
    (DRAFT / "onpolicy_log.json").write_text(json.dumps(log, indent=1))
    print(f"exported step {log['step']} to {DRAFT}")


def score(args: argparse.Namespace) -> None:
    """Held-out figures of the committed draft and of ``<work>/best`` as exported (int8 layers, bf16
    embedding, read back and dequantised) on the run's held-out replies (``<work>/heldout.pt``)."""
    torch.set_num_threads(args.threads)
    heldout = torch.load(args.work / "heldout.pt", weights_only=False)
    for name, path in (("committed", DRAFT), ("best", args.work / "best")):
        if (path / "model.safetensors").exists():
            draft = load_draft(path)
            print(f"{name} ({draft.config.num_hidden_layers} layers): {evaluate(draft, heldout)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.onpolicy", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=("train", "export", "evaluate"), required=True)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--minutes", type=float, default=150, help="training time of the whole run (cosine schedule)")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--kl-weight", type=float, default=0.3)
    ap.add_argument("--tv-weight", type=float, default=1.0, help="0: forward KL alone, the committed draft's objective")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-batch", type=int, default=16, help="replies the draft writes a round")
    ap.add_argument("--steps-per-round", type=int, default=12)
    ap.add_argument("--buffer", type=int, default=96, help="replies kept for replay")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--heldout", type=int, default=96, help="held-out replies")
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
    {"train": train, "export": export, "evaluate": score}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
