"""Train the embedded target/draft model pair on the Python standard library.

Everything is reproducible from this file and the Python installation that runs it:

* corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted),
  excluding ``site-packages/`` and ``dist-packages/`` and files that are not
  valid UTF-8;
* held-out split: a file is held out when the first 8 hex digits of
  ``sha256(relative_path)`` modulo 1000 is below 30 (about 3 % of files);
  held-out files are never used for the tokenizer or the models;
* a byte-level BPE tokenizer trained on the training files only;
* two ``LlamaForCausalLM`` models (a draft and a target) trained from scratch
  with AdamW, linear warmup and cosine decay, fixed seeds, and batches drawn
  from a seeded generator keyed by the step number (so ``--resume`` reproduces
  the same data order);
* then the draft is fine-tuned for ``--distill-steps`` towards the target's
  next-token distribution (KL), which raises draft/target agreement.

Usage::

    python -m training.embedded_pair                 # prep, draft, target, distill, export + eval
    python -m training.embedded_pair --resume        # continue from .train/ checkpoints
    python -m training.embedded_pair --stage target --resume   # one stage: prep|draft|target|distill|export
    python -m training.embedded_pair --eval          # held-out ppl, argmax agreement, greedy-SD simulation
    python -m training.embedded_pair --bench         # measure training throughput of a few sizes
    python -m training.embedded_pair --prompts assets/prompts/code.jsonl   # rebuild the code prompts
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import signal
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from mtad.decoding import decode, encode_prompt
from mtad.metrics import pool as pool_runs
from mtad.metrics import summarize
from mtad.models.pair import load
from mtad.prompts import read_prompts
from mtad.settings import Settings

Log = Callable[[str], None]

EOS = "<|endoftext|>"
HELDOUT_PER_MILLE = 30
DEFAULT_OUT = Path("assets/models")
DEFAULT_WORK = Path(".train")


# --------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16) % 1000 < HELDOUT_PER_MILLE


def list_corpus(root: Path | None = None) -> tuple[list[str], list[str], list[str]]:
    """Return (train, heldout, skipped) relative posix paths, each sorted."""
    root = root or stdlib_root()
    train, heldout, skipped = [], [], []
    for path in sorted(root.rglob("*.py")):
        rel_parts = path.relative_to(root).parts
        if "site-packages" in rel_parts or "dist-packages" in rel_parts:
            continue
        if "__pycache__" in rel_parts or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        (heldout if is_heldout(rel) else train).append(rel)
    return train, heldout, skipped


def read_text(rel: str, root: Path | None = None) -> str:
    return ((root or stdlib_root()) / rel).read_bytes().decode("utf-8")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok: Any) -> Any:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
        model_max_length=1024,
    )


def encode_docs(hf_tok: Any, texts: list[str]) -> np.ndarray:
    """Concatenate documents, each followed by <|endoftext|>; the stream starts with one."""
    eos = hf_tok.convert_tokens_to_ids(EOS)
    ids = hf_tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
    out = [eos]
    for doc in ids:
        out.extend(doc)
        out.append(eos)
    return np.asarray(out, dtype=np.uint16)


def prepare(work: Path, vocab_size: int, log: Log = print) -> dict:
    """Build (or reuse) the tokenizer and token streams under ``work``."""
    meta_path = work / "data" / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("vocab_size") == vocab_size:
            return meta
    (work / "data").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    root = stdlib_root()
    train, heldout, skipped = list_corpus(root)
    train_texts = [read_text(r, root) for r in train]
    held_texts = [read_text(r, root) for r in heldout]
    tok = train_tokenizer(train_texts, vocab_size)
    hf_tok = wrap_tokenizer(tok)
    hf_tok.save_pretrained(work / "data" / "tokenizer")
    train_ids = encode_docs(hf_tok, train_texts)
    held_ids = encode_docs(hf_tok, held_texts)
    np.save(work / "data" / "train.npy", train_ids)
    np.save(work / "data" / "heldout.npy", held_ids)
    (work / "data" / "heldout_files.txt").write_text("".join(r + "\n" for r in heldout))
    meta = {
        "vocab_size": vocab_size,
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "n_train_files": len(train),
        "n_heldout_files": len(heldout),
        "n_skipped_files": len(skipped),
        "skipped_files": skipped,
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "heldout_bytes": sum(len(t.encode()) for t in held_texts),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "prep_seconds": round(time.time() - t0, 1),
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    log(f"prep: {json.dumps({k: v for k, v in meta.items() if k != 'skipped_files'})}")
    return meta


# --------------------------------------------------------------------------- models


@dataclass
class Size:
    hidden: int
    layers: int
    heads: int
    ffn: int
    kv_heads: int | None = None


SIZES = {
    "draft": Size(hidden=64, layers=2, heads=2, ffn=192),
    "target": Size(hidden=160, layers=6, heads=5, ffn=432),
}


def make_config(size: Size, vocab_size: int, eos_id: int, max_pos: int) -> Any:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads or size.heads,
        max_position_embeddings=max_pos,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )


def make_model(config: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def n_params(model: Any) -> int:
    # parameters() yields a tied tensor once, so this counts tied embeddings once
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- training


@dataclass
class TrainCfg:
    name: str
    steps: int
    batch: int
    seq: int
    lr: float
    warmup: int
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    seed: int = 1234
    eval_every: int = 200
    ckpt_minutes: float = 3.0
    threads: int = 0  # 0: pick 1 or 2 threads by timing both every 150 steps (shared CPU)


def lr_at(step: int, cfg: TrainCfg) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def get_batch(data: np.ndarray, step: int, cfg: TrainCfg) -> torch.Tensor:
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, data.size - cfg.seq - 1, size=cfg.batch)
    x = np.stack([data[s : s + cfg.seq + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(x)


def heldout_windows(data: np.ndarray, seq: int, max_tokens: int | None = None) -> torch.Tensor:
    n = (data.size - 1) // seq
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq))
    x = np.stack([data[i * seq : i * seq + seq + 1] for i in range(n)]).astype(np.int64)
    return torch.from_numpy(x)


@torch.no_grad()
def eval_loss(model: Any, windows: torch.Tensor, bs: int = 8) -> float:
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, windows.size(0), bs):
        w = windows[i : i + bs]
        logits = model(input_ids=w[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum"
        )
        tot += loss.item()
        cnt += w[:, 1:].numel()
    model.train()
    return tot / cnt


def save_ckpt(path: Path, model: Any, opt: Any, step: int, extra: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "torch_rng": torch.get_rng_state(),
            "np_rng": np.random.get_state(),
            "py_rng": random.getstate(),
            **extra,
        },
        tmp,
    )
    os.replace(tmp, path)


def train_model(
    model: Any,
    data: np.ndarray,
    held: np.ndarray,
    cfg: TrainCfg,
    work: Path,
    resume: bool,
    log: Log = print,
    teacher: Any = None,
) -> dict:
    """Train ``model`` on random windows of ``data``: next-token cross-entropy, or, with a
    ``teacher``, KL(teacher || model) on the same windows (distillation)."""
    ckdir = work / cfg.name
    ckdir.mkdir(parents=True, exist_ok=True)
    ckpt = ckdir / "ckpt.pt"
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    step, elapsed, history = 0, 0.0, []
    if resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed, history = st["step"], st.get("elapsed", 0.0), st.get("history", [])
        torch.set_rng_state(st["torch_rng"])
        np.random.set_state(st["np_rng"])
        random.setstate(st["py_rng"])
        log(f"[{cfg.name}] resumed at step {step}")
    if step >= cfg.steps:
        return {"steps": step, "elapsed": elapsed, "history": history}
    eval_w = heldout_windows(held, cfg.seq, max_tokens=64 * 1024)
    model.train()
    t_start = time.time() - elapsed
    last_ckpt = time.time()
    t_log, tok_log = time.time(), 0
    probe: dict[int, float] = {}
    step0 = step
    stop = []  # SIGTERM/SIGINT: checkpoint at the end of the current step and return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    if cfg.threads == 0:
        torch.set_num_threads(1)
    while step < cfg.steps:
        if cfg.threads == 0:
            # the CPU is shared with other jobs: two OpenMP threads straggle when one
            # core is busy, so time 10 steps with each and keep the faster setting
            phase = (step - step0) % 150
            if phase == 0 or (phase == 10 and 1 in probe):
                if phase == 10:
                    probe[1] = time.time() - probe[1]
                probe[2 if phase == 10 else 1] = time.time()
                torch.set_num_threads(2 if phase == 10 else 1)
            elif phase == 20 and len(probe) == 2:
                probe[2] = time.time() - probe[2]
                torch.set_num_threads(1 if probe[1] < probe[2] else 2)
                log(f"[{cfg.name}] 10 steps: 1 thread {probe[1]:.1f}s, 2 threads {probe[2]:.1f}s")
                probe = {}
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = get_batch(data, step, cfg)
        out = model(input_ids=batch[:, :-1])
        logits = out.logits
        if teacher is None:
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                t_logp = torch.log_softmax(teacher(input_ids=batch[:, :-1]).logits.float(), -1)
            s_logp = torch.log_softmax(logits.float(), -1)
            loss = torch.nn.functional.kl_div(
                s_logp.reshape(-1, s_logp.size(-1)),
                t_logp.reshape(-1, t_logp.size(-1)),
                log_target=True,
                reduction="batchmean",
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tok_log += cfg.batch * cfg.seq
        if step % 50 == 0:
            dt = time.time() - t_log
            log(
                f"[{cfg.name}] step {step}/{cfg.steps} loss {loss.item():.4f} lr {lr:.2e} "
                f"{tok_log / dt:.0f} tok/s elapsed {time.time() - t_start:.0f}s"
            )
            t_log, tok_log = time.time(), 0
        if step % cfg.eval_every == 0 or step == cfg.steps:
            hl = eval_loss(model, eval_w)
            history.append({"step": step, "heldout_loss": round(hl, 4), "elapsed": round(time.time() - t_start, 1)})
            log(f"[{cfg.name}] step {step} heldout loss {hl:.4f} ppl {math.exp(hl):.2f}")
        if time.time() - last_ckpt > cfg.ckpt_minutes * 60 or step == cfg.steps or stop:
            save_ckpt(
                ckpt, model, opt, step, {"elapsed": time.time() - t_start, "history": history, "cfg": asdict(cfg)}
            )
            last_ckpt = time.time()
            if stop:
                log(f"[{cfg.name}] stopped by signal at step {step}; resume with --resume")
                break
    return {"steps": step, "elapsed": time.time() - t_start, "history": history}


def write_info(folder: Path, args_info: dict, model: Any, res: dict, cfg: TrainCfg) -> None:
    """``info.json`` of one trained model: the arguments, size, steps, tokens seen, time and loss history."""
    info = {
        "args": args_info,
        "params": n_params(model),
        "steps": res["steps"],
        "tokens_seen": res["steps"] * cfg.batch * cfg.seq,
        "train_seconds": round(res["elapsed"], 1),
        "history": res["history"],
        "cfg": asdict(cfg),
    }
    (folder / "info.json").write_text(json.dumps(info, indent=1))


def load_trained(work: Path, name: str, config: Any) -> tuple[Any, dict]:
    model = make_model(config, 0)
    st = torch.load(work / name / "ckpt.pt", weights_only=False)
    model.load_state_dict(st["model"])
    return model, st


# --------------------------------------------------------------------------- export / eval


def export(model: Any, work: Path, out_dir: Path, eos_id: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(work / "data" / "tokenizer").save_pretrained(out_dir)
    # portable tokenizer_config: the class name older transformers versions know, no load-time flags
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only"):
        tc.pop(k, None)
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")


@torch.no_grad()
def evaluate_dirs(out: Path, seq: int = 512, max_tokens: int | None = None, log: Log = print) -> dict:
    """Held-out perplexity of both models and argmax agreement (draft vs target)."""
    heldout = [ln for ln in (out / "heldout_files.txt").read_text().splitlines() if ln]
    tok = AutoTokenizer.from_pretrained(out / "target")
    ids = encode_docs(tok, [read_text(r) for r in heldout])
    windows = heldout_windows(ids, seq, max_tokens)
    models = {n: AutoModelForCausalLM.from_pretrained(out / n).eval() for n in ("draft", "target")}
    nll = {n: 0.0 for n in models}
    agree, count = 0, 0
    for i in range(0, windows.size(0), 8):
        w = windows[i : i + 8]
        y = w[:, 1:].reshape(-1)
        am = {}
        for n, m in models.items():
            lg = m(input_ids=w[:, :-1]).logits.float().reshape(-1, m.config.vocab_size)
            nll[n] += torch.nn.functional.cross_entropy(lg, y, reduction="sum").item()
            am[n] = lg.argmax(-1)
        agree += (am["draft"] == am["target"]).sum().item()
        count += y.numel()
    a = agree / count
    res = {
        "heldout_files": len(heldout),
        "heldout_tokens_scored": count,
        "seq": seq,
        "ppl_draft": math.exp(nll["draft"] / count),
        "ppl_target": math.exp(nll["target"] / count),
        "argmax_agreement": a,
        "proxy_tokens_per_target_call_gamma4": (1 - a**5) / (1 - a),
        "params_draft": n_params(models["draft"]),
        "params_target": n_params(models["target"]),
    }
    res["ppl_target_over_draft"] = res["ppl_target"] / res["ppl_draft"]
    log(json.dumps(res, indent=1))
    return res


@torch.no_grad()
def simulate_greedy_sd(out: Path, prompts: Path, gamma: int = 4, max_new_tokens: int = 128, log: Log = print) -> dict:
    """Tokens per target call of greedy speculative decoding on the exported pair, measured by running the
    engine's own ``sd`` decoder (no second model of SD here) and folded by ``mtad.metrics``."""
    pair = load(str(out / "draft"), str(out / "target"), device="cpu")
    settings = Settings(method="sd", greedy=True, gamma=gamma, max_new_tokens=max_new_tokens)
    runs = [
        summarize(list(decode(pair, encode_prompt(pair, p.text, settings), settings))) for p in read_prompts(prompts)
    ]
    pooled = pool_runs(runs)
    res = {
        "prompts": len(runs),
        "gamma": gamma,
        "max_new_tokens": max_new_tokens,
        "mean_tokens_per_target_call": sum(m.block_efficiency for m in runs) / len(runs),
        "aggregate_tokens_per_target_call": pooled.block_efficiency,
        "acceptance": pooled.acceptance,
        "generated_tokens": pooled.new_tokens,
    }
    log(json.dumps(res, indent=1))
    return res


# --------------------------------------------------------------------------- prompts


def _prompt_candidates(rel: str, text: str) -> list[dict]:
    """Function/class headers with the start of their body, cut at line ends."""

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    parents: dict = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
            continue
        if isinstance(node, ast.ClassDef):
            category = "class"
        else:
            category = "method" if isinstance(parents.get(node), ast.ClassDef) else "function"
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        first = node.body[0]
        is_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
        is_doc = is_doc and isinstance(first.value.value, str)
        if is_doc:
            end = first.lineno  # header + the docstring's first line
            if not lines[end - 1].strip().strip("\"'rbuRBU"):
                end += 1  # opening quotes alone on their line: include the next one
        else:
            end = min(first.lineno - 1 + 3, node.end_lineno or first.lineno)  # header + 3 body lines
        # no trailing whitespace: BPE merges "\n" with the next line's indentation, so a prompt
        # ending in a lone "\n" token would steer the models towards column-0 code
        prompt = "".join(lines[start:end]).rstrip()
        if 50 <= len(prompt) <= 400 and prompt.strip():
            out.append({"id": f"{rel}:{node.lineno}", "category": category, "prompt": prompt})
    out.sort(key=lambda c: int(c["id"].rsplit(":", 1)[1]))
    return out


def build_code_prompts(heldout: list[str], train: list[str], n: int = 60, per_file: int = 3) -> list[dict]:
    """Pick prompts from held-out files only; drop any that occurs verbatim in a training file."""
    root = stdlib_root()
    train_blob = "\0".join(read_text(r, root) for r in train)
    chosen: list[dict] = []
    pools = []
    for rel in heldout:
        cands = [c for c in _prompt_candidates(rel, read_text(rel, root)) if c["prompt"] not in train_blob]
        if cands:
            # spread the picks evenly over the file
            k = min(per_file, len(cands))
            pools.append([cands[(i * len(cands)) // k] for i in range(k)])
    for rnd in range(per_file):
        for pool in pools:
            if rnd < len(pool) and len(chosen) < n:
                chosen.append(pool[rnd])
    return chosen


def write_code_prompts(path: Path, n: int = 60) -> list[dict]:
    train, heldout, _ = list_corpus()
    prompts = build_code_prompts(heldout, train, n=n)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    return prompts


# --------------------------------------------------------------------------- bench


def bench(vocab_size: int, seq: int, batch: int, sizes: dict[str, Size], steps: int = 4, log: Log = print) -> None:
    data = np.random.default_rng(0).integers(0, vocab_size, size=200_000).astype(np.uint16)
    for name, size in sizes.items():
        model = make_model(make_config(size, vocab_size, 0, 1024), 0)
        cfg = TrainCfg(name=name, steps=steps, batch=batch, seq=seq, lr=1e-3, warmup=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for s in range(steps + 1):
            if s == 1:
                t0 = time.time()
            b = get_batch(data, s, cfg)
            loss = torch.nn.functional.cross_entropy(
                model(input_ids=b[:, :-1]).logits.reshape(-1, vocab_size), b[:, 1:].reshape(-1)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        tps = steps * batch * seq / (time.time() - t0)
        log(f"bench {name} {asdict(size)} params {n_params(model):,} seq {seq} batch {batch}: {tps:.0f} tok/s")


# --------------------------------------------------------------------------- main


def parse_size(s: str) -> Size:
    h, n_layers, nh, f = (int(x) for x in s.split(","))
    return Size(hidden=h, layers=n_layers, heads=nh, ffn=f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.embedded_pair", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--stage", choices=["all", "prep", "draft", "target", "distill", "export"], default="all")
    ap.add_argument("--resume", action="store_true", help="continue from checkpoints in --work")
    ap.add_argument("--eval", action="store_true", help="evaluate the exported pair in --out and exit")
    ap.add_argument("--eval-max-tokens", type=int, default=None)
    ap.add_argument("--sd-prompts", type=Path, default=Path("assets/prompts/code.jsonl"))
    ap.add_argument("--prompts", type=Path, default=None, help="write code prompts (JSONL) to this path and exit")
    ap.add_argument("--bench", action="store_true", help="measure training throughput and exit")
    ap.add_argument("--draft-size", type=parse_size, default=None, help="hidden,layers,heads,ffn")
    ap.add_argument("--target-size", type=parse_size, default=None, help="hidden,layers,heads,ffn")
    ap.add_argument("--draft-steps", type=int, default=2000)
    ap.add_argument("--target-steps", type=int, default=2000)
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--target-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--distill-steps", type=int, default=1000, help="KD fine-tuning steps of the draft (0: none)")
    ap.add_argument("--distill-lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="0: adapt between 1 and 2")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads or 2)
    sizes = dict(SIZES)
    if args.draft_size:
        sizes["draft"] = args.draft_size
    if args.target_size:
        sizes["target"] = args.target_size

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    if args.eval:
        evaluate_dirs(args.out, seq=args.seq, max_tokens=args.eval_max_tokens, log=log)
        if args.sd_prompts.exists():
            simulate_greedy_sd(args.out, args.sd_prompts, log=log)
        return 0
    if args.prompts:
        ps = write_code_prompts(args.prompts)
        log(f"wrote {len(ps)} code prompts to {args.prompts}")
        return 0
    if args.bench:
        bench(args.vocab_size, args.seq, args.draft_batch, sizes, log=log)
        return 0

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    meta = prepare(work, args.vocab_size, log=log)
    if args.stage == "prep":
        return 0
    data = np.load(work / "data" / "train.npy")
    held = np.load(work / "data" / "heldout.npy")
    eos_id = AutoTokenizer.from_pretrained(work / "data" / "tokenizer").convert_tokens_to_ids(EOS)
    args_info = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args_info["draft_size"] = asdict(sizes["draft"])
    args_info["target_size"] = asdict(sizes["target"])

    for name, steps, batch, lr, seed_off in (
        ("draft", args.draft_steps, args.draft_batch, args.draft_lr, 1),
        ("target", args.target_steps, args.target_batch, args.target_lr, 2),
    ):
        if args.stage not in ("all", name):
            continue
        config = make_config(sizes[name], meta["vocab_size"], eos_id, args.max_pos)
        model = make_model(config, args.seed + seed_off)
        log(f"[{name}] params {n_params(model):,} size {asdict(sizes[name])}")
        cfg = TrainCfg(
            name=name,
            steps=steps,
            batch=batch,
            seq=args.seq,
            lr=lr,
            warmup=args.warmup,
            seed=args.seed + seed_off,
            threads=args.threads,
        )
        res = train_model(model, data, held, cfg, work, args.resume, log=log)
        write_info(work / name, args_info, model, res, cfg)

    if args.distill_steps and args.stage in ("all", "distill"):
        # optional: fine-tune the trained draft towards the trained target's distribution
        config = make_config(sizes["draft"], meta["vocab_size"], eos_id, args.max_pos)
        model, _ = load_trained(work, "draft", config)
        teacher, _ = load_trained(
            work, "target", make_config(sizes["target"], meta["vocab_size"], eos_id, args.max_pos)
        )
        teacher.eval()
        cfg = TrainCfg(
            name="draft_kd",
            steps=args.distill_steps,
            batch=args.draft_batch,
            seq=args.seq,
            lr=args.distill_lr,
            warmup=min(args.warmup, args.distill_steps // 10 + 1),
            seed=args.seed + 3,
            threads=args.threads,
        )
        res = train_model(model, data, held, cfg, work, args.resume, log=log, teacher=teacher)
        write_info(work / "draft_kd", args_info, model, res, cfg)

    if args.stage in ("all", "export"):
        for name in ("draft", "target"):
            config = make_config(sizes[name], meta["vocab_size"], eos_id, args.max_pos)
            src = "draft_kd" if name == "draft" and args.distill_steps else name
            model, _ = load_trained(work, src, config)
            export(model, work, args.out / name, eos_id)
        (args.out / "heldout_files.txt").write_text((work / "data" / "heldout_files.txt").read_text())
        log(f"exported to {args.out}")
        report = {"corpus": {k: v for k, v in meta.items()}, "torch": torch.__version__}
        for name in ("draft", "target") + (("draft_kd",) if args.distill_steps else ()):
            report[name] = json.loads((work / name / "info.json").read_text())
        report["eval"] = evaluate_dirs(args.out, seq=args.seq, log=log)
        if args.sd_prompts.exists():
            report["greedy_sd_simulation"] = simulate_greedy_sd(args.out, args.sd_prompts, log=log)
        (args.out / "train_report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
