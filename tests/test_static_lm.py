"""The compiled engine: the target over a static key/value buffer gives the eager engine's logits (cached
logits equal a full recompute, after rollbacks and row and position operations), its compiled shapes give
greedy decoders that equal greedy AR token for token, and steady-state decoding never recompiles."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from conftest import cached_next_logits, full_logits, needs_onednn_bf16
from test_architectures import opt
from test_shortlist_draft import micro_int8_pair  # noqa: F401 (a fixture, used by name)
from test_tree import check_tree_forward

from mtad.decoding import generate, static_lm
from mtad.decoding.kv import CachedLM
from mtad.decoding.precompile import WARMED, needs_warm_up, warm_up_pair, warm_up_settings
from mtad.decoding.state import DecodeState, draft_lm
from mtad.decoding.static_lm import TREE_BUCKETS, StaticLM
from mtad.decoding.tree import TokenTree, keep_path, tree_allow
from mtad.models.errors import PairError
from mtad.models.kernels import candidates, use_linear_kernel
from mtad.models.shortlist_draft import int8_kernel_input
from mtad.models.static_llama import _attention, discard_broken_cache, layers_per_call, resolve_engine, supports
from mtad.settings import PARAMS, Settings

ROOT = Path(__file__).resolve().parent.parent


def feed_both(eager: CachedLM, static: StaticLM, tokens: list[list[int]], keep: int = 1) -> None:
    """Feed the same tokens to both and check their logits agree."""
    ids = torch.tensor(tokens)
    torch.testing.assert_close(static.feed(ids, keep=keep), eager.feed(ids, keep=keep), rtol=1e-4, atol=1e-4)


def test_static_forward_equals_a_full_recompute_after_rollbacks(tiny_pair) -> None:
    ids = tiny_pair.encode("abc def gh abba cafe")
    lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False)
    lm.feed(torch.tensor([ids[:-4]]))
    for i in range(len(ids) - 4, len(ids)):  # one token at a time
        torch.testing.assert_close(
            lm.feed(torch.tensor([[ids[i]]]))[0, -1], full_logits(tiny_pair.target, ids[: i + 1])
        )
    lm.rollback(len(ids) - 4)
    block = lm.feed(torch.tensor([ids[-4:]]), keep=4)[0]  # a verification block, every position's logits
    for j in range(4):
        expected = full_logits(tiny_pair.target, ids[: len(ids) - 3 + j])
        torch.testing.assert_close(block[j], expected, rtol=1e-5, atol=1e-5)
    lm.rollback(5)  # far back: the stale slots past it must be masked, then overwritten
    other = [7, 3, 9, 12]
    logits = lm.feed(torch.tensor([other]), keep=1)[0, -1]
    torch.testing.assert_close(logits, full_logits(tiny_pair.target, ids[:5] + other), rtol=1e-5, atol=1e-5)
    assert lm.length == 9


@pytest.mark.parametrize("most", [1, 6])
def test_layers_run_compiled_in_equal_calls(monkeypatch: pytest.MonkeyPatch, tiny_pair, most: int) -> None:
    """A model's layers run in compiled calls of the largest divisor of their count up to a bound (SmolLM2's
    30 in five calls of six); the tiny target's two layers in two calls or in one give the full recompute's
    logits."""
    assert [layers_per_call(n) for n in (30, 2, 6, 7, 8, 1)] == [6, 2, 6, 1, 4, 1]
    monkeypatch.setattr("mtad.models.static_llama.MOST_LAYERS_PER_CALL", most)
    assert layers_per_call(2) == min(most, 2)
    ids = tiny_pair.encode("abc def gh abba cafe")
    lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size)
    lm.feed(torch.tensor([ids[:-3]]))
    for i in range(len(ids) - 3, len(ids)):
        expected = full_logits(tiny_pair.target, ids[: i + 1])
        torch.testing.assert_close(lm.feed(torch.tensor([[ids[i]]]))[0, -1], expected, rtol=1e-4, atol=1e-4)


def test_capacity_grows_without_losing_the_context(tiny_pair) -> None:
    lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False)
    ids = [(7 * i) % 50 + 1 for i in range(300)]  # past the first capacity step (256)
    lm.feed(torch.tensor([ids[:250]]))
    assert lm.cache.capacity == 256
    logits = lm.feed(torch.tensor([ids[250:]]), keep=1)[0, -1]
    assert lm.cache.capacity == 512
    torch.testing.assert_close(logits, full_logits(tiny_pair.target, ids), rtol=1e-4, atol=1e-4)


def test_row_and_position_operations_match_the_eager_cache(tiny_pair) -> None:
    """Fan out, reorder (beam search), keep a row and keep a tree path: afterwards both caches give the
    same logits for the same tokens."""
    ids = tiny_pair.encode("abc def gh")
    eager = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
    static = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False)
    feed_both(eager, static, [ids])
    for lm in (eager, static):
        lm.cache.fan_out(3)
    assert static.cache.rows == 3
    feed_both(eager, static, [[5], [6], [7]])
    parent = torch.tensor([2, 0, 0])
    for lm in (eager, static):
        lm.cache.reorder(parent)
    feed_both(eager, static, [[8], [9], [10]], keep=1)
    for lm in (eager, static):
        lm.cache.keep_row(1)
    assert static.cache.rows == 1
    feed_both(eager, static, [[11, 12]], keep=2)
    keep = list(range(len(ids))) + [len(ids) + 1, len(ids) + 3]
    for lm in (eager, static):
        lm.cache.keep_positions(keep)
    assert static.length == eager.length == len(keep)
    feed_both(eager, static, [[13]])


def test_stale_slots_past_the_context_change_nothing(tiny_pair) -> None:
    """Rolled-back slots hold old keys and values: filled with NaN, a forward that reads only the context
    is unchanged; with CUDA graphs' fixed inputs (the whole capacity, masked), finite garbage is."""
    ids = tiny_pair.encode("abc def gh abba cafe")
    for graphs, junk in ((False, float("nan")), (True, 1e4)):
        lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False, graphs=graphs)
        lm.feed(torch.tensor([ids]))
        lm.rollback(6)
        with torch.inference_mode():  # the buffers are inference tensors
            for buf in lm.cache.tensors():
                buf[:, :, 6:] = junk
        logits = lm.feed(torch.tensor([[ids[6]]]))[0, -1]
        torch.testing.assert_close(logits, full_logits(tiny_pair.target, ids[:7]), rtol=1e-5, atol=1e-5)


def test_fixed_input_forwards_match_the_eager_cache_across_generations(tiny_pair) -> None:
    """The CUDA-graph path's bookkeeping, run with plain calls on a CPU: fixed inputs over the whole
    capacity, one kept buffer set per row count, forwards keyed by shape. Random verifications and
    rollbacks, beams fanning out and back, a tree path and a larger capacity all give the eager cache's
    logits; a second generation reuses the first one's buffers and shapes."""
    prompt = tiny_pair.encode("abc def gh")
    for generation in range(2):
        gen = torch.Generator().manual_seed(0)  # the same forwards both times
        eager = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
        static = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False, graphs=True)
        assert static.graphs is not None and static.length == 0
        shapes = len(static.graphs.shapes)
        feed_both(eager, static, [prompt])
        for _ in range(12):
            n = int(torch.randint(1, 5, (), generator=gen))
            block = torch.randint(1, tiny_pair.vocab_size, (n,), generator=gen).tolist()
            feed_both(eager, static, [block], keep=n)
            back = eager.length - int(torch.randint(0, n, (), generator=gen))
            for lm in (eager, static):
                lm.rollback(back)
            for lm in (eager, static):  # a beam step: fan out, reorder, back to one row
                lm.cache.fan_out(3)
            feed_both(eager, static, [[5], [6], [7]])
            for lm in (eager, static):
                lm.cache.reorder(torch.tensor([2, 0, 0]))
                lm.cache.keep_row(1)
            assert static.cache.rows == 1
        keep = list(range(len(prompt))) + [eager.length - 2, eager.length - 1]
        for lm in (eager, static):
            lm.cache.keep_positions(keep)
        feed_both(eager, static, [[13, 14]], keep=2)
        if generation == 0:
            first = static.graphs
            assert len(first.shapes) <= 4 * 2 + 1  # (1..4 tokens) x (keep 1 or all) + one beam shape
            del static, lm  # the generation ends: its buffers and shapes go back to the model
        else:
            assert static.graphs is first and len(static.graphs.shapes) == shapes  # reused, nothing new
    lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False, graphs=True)
    lm.cache.step = 64
    ids = [(7 * i) % 50 + 1 for i in range(70)]
    lm.feed(torch.tensor([ids[:60]]))
    epoch = lm.cache.epoch
    lm.feed(torch.tensor([ids[60:64]]), keep=1)
    assert lm.graphs.shapes and lm.cache.capacity == 64
    logits = lm.feed(torch.tensor([ids[64:69]]), keep=5)[0]  # outgrows the capacity: new buffers
    assert lm.cache.capacity == 128 and lm.cache.epoch == epoch + 1
    assert len(lm.graphs.shapes) == 1  # the shapes over the old buffers are void
    for j in range(5):
        torch.testing.assert_close(logits[j], full_logits(tiny_pair.target, ids[: 65 + j]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("graphs", [False, True])
def test_row_operations_that_copy_only_what_differs_keep_the_eager_cache_s_logits(tiny_pair, graphs: bool) -> None:
    """Beams reorder only their drafted positions, and a kept buffer set is refreshed from where its copy of
    the shared context ends: random fan-outs to 2 or 3 rows, reorders, selections down to fewer rows,
    rollbacks into the shared context and tree paths, with every forward's logits equal to the eager
    cache's (which copies everything)."""
    gen = torch.Generator().manual_seed(3)
    prompt = tiny_pair.encode("abc def gh")
    eager = CachedLM(tiny_pair.target, tiny_pair.vocab_size)
    static = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False, graphs=graphs)

    def rand(*shape: int) -> list:
        return torch.randint(1, tiny_pair.vocab_size, shape, generator=gen).tolist()

    def draw(n: int) -> int:
        return int(torch.randint(0, n, (), generator=gen))

    feed_both(eager, static, [prompt])
    for lm in (eager, static):  # the kept set of 3 rows holds the prompt ...
        lm.cache.fan_out(3)
    feed_both(eager, static, rand(3, 1))
    for lm in (eager, static):  # ... whose end is then rolled back and written anew in one row
        lm.cache.keep_row(2)
        lm.rollback(len(prompt) - 3)
    feed_both(eager, static, rand(1, 4), keep=4)
    for lm in (eager, static):
        lm.cache.fan_out(3)
    feed_both(eager, static, rand(3, 2), keep=2)
    rolled_into_shared = 0
    for _ in range(200):
        rows = static.cache.rows
        op = draw(5)
        if op == 0 and rows == 1:  # fan out, then beam steps
            width = 2 + draw(2)
            for lm in (eager, static):
                lm.cache.fan_out(width)
            for _ in range(1 + draw(3)):
                feed_both(eager, static, rand(width, 1))
                parent = torch.randint(0, width, (width,), generator=gen)
                for lm in (eager, static):
                    lm.cache.reorder(parent)
        elif op == 1 and rows > 1:  # keep fewer rows, in a new order
            index = torch.randperm(rows, generator=gen)[: 1 + draw(rows)]
            for lm in (eager, static):
                lm.cache.select_rows(index)
        elif op == 2:  # roll back, sometimes into the context the rows share
            back = eager.length - draw(6)
            rolled_into_shared += back < static.cache.shared
            for lm in (eager, static):
                lm.rollback(back)
        elif op == 3 and rows == 1:  # a tree path
            n = eager.length
            keep = list(range(n - 4)) + [n - 3, n - 1]
            for lm in (eager, static):
                lm.cache.keep_positions(keep)
        else:
            n = 1 + draw(3)
            feed_both(eager, static, rand(rows, n), keep=n)
        assert static.cache.rows == eager.cache.rows and static.length == eager.length
    assert rolled_into_shared > 0  # the case where a kept set's copy of the context goes stale
    for lm in (eager, static):
        lm.cache.keep_row(0)
    feed_both(eager, static, [rand(3)], keep=3)


def test_tree_verification_on_the_compiled_engine(tiny_pair) -> None:
    check_tree_forward(dataclasses.replace(tiny_pair, engine="compiled"))


def random_tree(size: int, gen: torch.Generator, vocab: int) -> TokenTree:
    """A token tree of ``size`` nodes, each a child of the context or of an earlier node, at random."""
    tokens = torch.randint(1, vocab, (size,), generator=gen).tolist()
    parents = [int(torch.randint(-1, i, (), generator=gen)) if i else -1 for i in range(size)]
    depths: list[int] = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return TokenTree(tokens, parents, depths, paths=[])


def path_to(tree: TokenTree, node: int) -> list[int]:
    """The nodes from the context down to ``node``."""
    path = [node]
    while tree.parents[path[0]] >= 0:
        path.insert(0, tree.parents[path[0]])
    return path


def check_trees(lm: StaticLM, pair, sizes: list[int], seed: int = 0) -> None:  # noqa: ANN001
    """A random tree of each size over the same context: three nodes' logits equal a full recompute, and
    after keeping one node's path the cache gives a full recompute's next logits."""
    ids = pair.encode("abc de fgh bad cafe")
    lm.feed(torch.tensor([ids]))
    gen = torch.Generator().manual_seed(seed)
    for size in sizes:
        tree = random_tree(size, gen, pair.vocab_size)
        positions = [len(ids) + d for d in tree.depths]
        logits = lm.feed_masked(torch.tensor([tree.tokens]), positions, tree_allow(tree, len(ids), 0))[0]
        assert logits.shape[0] == size and lm.length == len(ids) + size
        for node in torch.randint(0, size, (3,), generator=gen).tolist():
            want = full_logits(pair.target, ids + [tree.tokens[i] for i in path_to(tree, node)])
            torch.testing.assert_close(logits[node], want, rtol=1e-4, atol=1e-4)
        path = path_to(tree, size - 1)
        keep_path(lm, len(ids), path)
        kept = ids + [tree.tokens[i] for i in path] + [3]
        torch.testing.assert_close(cached_next_logits(lm, kept), full_logits(pair.target, kept), rtol=1e-4, atol=1e-4)
        lm.rollback(len(ids))


def test_tree_forwards_from_graphs_run_padded_to_a_few_sizes(monkeypatch: pytest.MonkeyPatch, tiny_pair) -> None:
    """Where forwards replay CUDA graphs (plain calls here), a token tree's forward runs padded to one of a
    few sizes: trees of 1 to 40 tokens take five shapes, not forty, and give a full recompute's logits; the
    padding's keys, written past the cache's length, change no later forward."""
    monkeypatch.setattr("mtad.decoding.static_lm.graphs_enabled", lambda device: True)
    lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size, compile=False)
    assert lm.graphs is not None
    sizes: list[int] = []  # the token count of every forward through the graphs' fixed inputs
    run = lm.graphs.run
    monkeypatch.setattr(lm.graphs, "run", lambda key, *args, **kw: sizes.append(key[1]) or run(key, *args, **kw))
    check_trees(lm, tiny_pair, list(range(1, 41)))
    masked = set(sizes) - {1}  # besides the one-token feeds of the checks
    assert masked == {8, 16, 24, 32, 48} and masked <= set(TREE_BUCKETS)


def test_trees_past_the_verification_s_token_count_run_compiled(monkeypatch: pytest.MonkeyPatch, tiny_pair) -> None:
    """On a CPU a tree is not padded, and one of more tokens than a verification's compiled bound (MTAD-tree's
    W = 8 beams of γ = 4 are up to 33) still runs in the compiled graph, with a full recompute's logits."""
    calls: list[tuple[int, bool]] = []
    forward = static_lm.llama_forward

    def spy(model, ids, *args, compiled: bool = True, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append((ids.shape[1], compiled))
        return forward(model, ids, *args, compiled=compiled, **kwargs)

    monkeypatch.setattr(static_lm, "llama_forward", spy)
    lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size)
    assert lm.graphs is None
    sizes = [static_lm.COMPILED_TOKENS + 4, 33]
    check_trees(lm, tiny_pair, sizes, seed=1)
    assert [(n, c) for n, c in calls if n in sizes] == [(n, True) for n in sizes]


GREEDY = [
    Settings(method="ar", greedy=True, max_new_tokens=24),
    Settings(method="sd", greedy=True, gamma=4, max_new_tokens=24),
    Settings(method="mtad", greedy=True, gamma=4, beams=3, max_new_tokens=24),
    Settings(method="mtad-tree", greedy=True, gamma=3, beams=3, max_new_tokens=24),
    Settings(method="specinfer", greedy=True, gamma=3, num_drafts=3, max_new_tokens=24),
    Settings(method="spectr", greedy=True, gamma=3, num_drafts=3, max_new_tokens=24),
    Settings(method="bild", greedy=True, gamma=5, tau2=0.0, max_new_tokens=24),
    Settings(method="mtjd", greedy=True, gamma=2, beams=2, max_new_tokens=12),
]


def test_decoders_on_the_compiled_engine_give_the_eager_engine_s_text_and_never_recompile(close_pair) -> None:
    """Every decoder writes on the compiled engine what it writes on the eager one (greedy, and sampled with
    the same seed), so the exact ones equal greedy AR; after the engine's warm-ups (the pair's, then each
    setting's, as the page and the bench run them), two prompts of different lengths run on the shapes they
    compiled: no recompilation. (A CPU whose one-row forwards of up to six tokens take the ``gemv`` form,
    AVX2 in fp32, has a graph for each of those token counts: which ones a prompt meets varies, the warm-up
    compiles them all.)"""
    compiled = dataclasses.replace(close_pair, engine="compiled")
    torch._dynamo.reset()
    WARMED.pop(compiled.target, None)
    every = GREEDY + [dataclasses.replace(s, greedy=False, seed=3) for s in GREEDY[1:3]]
    warm_up_pair(compiled, max(s.gamma for s in every) + 1)
    for settings in every:
        warm_up_settings(compiled, settings)
    for prompt in ("abc def", "abc def gh abc bad cafe fed"):
        ar = generate(close_pair, prompt, GREEDY[0]).new_ids
        assert len(ar) > 10
        for settings in every:
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = generate(compiled, prompt, settings).new_ids
            assert got == generate(close_pair, prompt, settings).new_ids, settings
            if settings.greedy and settings.method in ("ar", "sd", "specinfer", "spectr", "bild"):
                assert got == ar[: settings.max_new_tokens], settings.method
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0  # the compiled path ran
    st = DecodeState.start(compiled, close_pair.encode("abc"), GREEDY[1])
    assert isinstance(st.target, StaticLM) and isinstance(st.draft, StaticLM)  # both models compiled


@pytest.mark.parametrize(
    "settings",
    [
        Settings(method="mtad-tree", gamma=3, beams=3, max_new_tokens=30, greedy=True),
        Settings(method="spectr", gamma=3, num_drafts=3, max_new_tokens=30, seed=5),
    ],
    ids=["tree", "spectr"],
)
def test_a_warm_up_compiles_every_shape_a_timed_generation_then_asks(close_pair, settings: Settings) -> None:
    """The page's lanes and ``generate`` compile a decoder's shapes untimed before its clock: after
    :func:`warm_up_settings`, a generation with those settings (another prompt and length, other τ or seed)
    compiles nothing, and writes the eager engine's text."""
    compiled = dataclasses.replace(close_pair, engine="compiled")
    torch._dynamo.reset()
    WARMED.pop(compiled.target, None)
    assert needs_warm_up(compiled, settings) and not needs_warm_up(close_pair, settings)
    warm_up_pair(compiled, settings.gamma + 1)  # as the page's load and generate do first
    assert warm_up_settings(compiled, settings)
    assert not needs_warm_up(compiled, settings) and not warm_up_settings(compiled, settings)
    assert not needs_warm_up(compiled, settings.with_(tau=0.5, seed=9, max_new_tokens=7))
    assert needs_warm_up(compiled, settings.with_(gamma=2))
    for prompt in ("abc def gh abc bad cafe fed", "fed"):
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = generate(compiled, prompt, settings).new_ids
        assert got == generate(close_pair, prompt, settings).new_ids


def test_decoders_over_fixed_input_forwards_give_the_eager_engine_s_text(
    monkeypatch: pytest.MonkeyPatch, close_pair
) -> None:
    """What a GPU runs from CUDA graphs, run with plain calls here: every decoder's forwards through the
    fixed inputs (whole-capacity mask, kept buffers, the compiled layer) write the eager engine's text,
    and a second prompt reuses the first one's shapes and buffers."""
    monkeypatch.setattr("mtad.decoding.static_lm.graphs_enabled", lambda device: True)
    compiled = dataclasses.replace(close_pair, engine="compiled")
    for prompt in ("abc def", "abc def gh abc bad cafe fed"):
        for settings in GREEDY[:6] + [dataclasses.replace(s, greedy=False, seed=3) for s in GREEDY[1:3]]:
            got = generate(compiled, prompt, settings).new_ids
            assert got == generate(close_pair, prompt, settings).new_ids, settings
    st = DecodeState.start(compiled, close_pair.encode("abc"), GREEDY[2])
    assert st.target.graphs is not None and st.draft.graphs is not None
    assert st.target.graphs.shapes  # kept from the runs above


def test_engine_choice_and_refusals(monkeypatch: pytest.MonkeyPatch, tiny_pair) -> None:
    monkeypatch.delenv("MTAD_ENGINE", raising=False)
    assert resolve_engine("compiled") == "compiled" and resolve_engine(None) == "auto"
    assert tiny_pair.engine == "eager" and supports(tiny_pair.target) is None
    monkeypatch.setenv("MTAD_ENGINE", "compiled")
    assert resolve_engine("auto") == "compiled"
    with pytest.raises(PairError, match="engine must be auto or one of eager, compiled"):
        resolve_engine("jit")
    other = opt(64, 32, 1, 1)
    assert "not a Llama-family" in supports(other)
    with pytest.raises(ValueError, match="compiled engine cannot run this model"):
        StaticLM(other, 64)


def test_auto_compiles_where_the_engine_can_run_the_target(monkeypatch: pytest.MonkeyPatch, tiny_dirs) -> None:
    """``auto`` (no ``MTAD_ENGINE``): a pair whose target is a Llama loads compiled, on a CPU or a GPU; a
    target the engine cannot run or a draft that reads the target's features keep the eager engine; a named
    engine stays."""
    import types

    from mtad.models.pair import load
    from mtad.models.static_llama import choose_engine

    monkeypatch.delenv("MTAD_ENGINE", raising=False)
    pair = load(*tiny_dirs, device="cpu")
    assert pair.engine == "compiled"
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert choose_engine("auto", cpu, pair.draft, pair.target) == "compiled"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_engine("auto", gpu, pair.draft, pair.target) == "compiled"  # CUDA graphs there
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    assert choose_engine("auto", gpu, pair.draft, pair.target) == "eager"  # no Triton kernels for a Pascal GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_engine("auto", cpu, pair.draft, opt(64, 32, 1, 1)) == "eager"
    assert choose_engine("auto", cpu, types.SimpleNamespace(reads_features=True), pair.target) == "eager"
    assert choose_engine("eager", cpu, pair.draft, pair.target) == "eager"
    spread = copy.deepcopy(pair.target)
    spread.lm_head.to("meta")  # a target split over devices (device_map="auto"): one cache cannot hold it
    assert choose_engine("auto", gpu, pair.draft, spread) == "eager"
    assert "split over several devices" in supports(spread)
    assert load(*tiny_dirs, device="cpu", engine="eager").engine == "eager"


def test_generate_decodes_one_prompt_eagerly_unless_told_and_compiles_before_its_clock(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tiny_dirs
) -> None:
    """``python -m mtad generate`` on ``auto`` runs eager (one prompt); ``--engine compiled`` compiles the
    models first and says how long that took, apart from the decoding's own speed."""
    from mtad.cli import main

    monkeypatch.delenv("MTAD_ENGINE", raising=False)
    draft, target = tiny_dirs
    common = ["generate", "--draft", draft, "--target", target, "--device", "cpu", "--prompt", "abc", "--json"]
    assert main(common + ["--max-new-tokens", "8"]) == 0
    assert "compiled engine" not in capsys.readouterr().err
    assert main(common + ["--max-new-tokens", "8", "--engine", "compiled"]) == 0
    assert "compiled engine: " in capsys.readouterr().err


def test_the_page_says_when_it_compiles_and_what_runs_compiled(monkeypatch: pytest.MonkeyPatch, tiny_dirs) -> None:
    """The page expects to compile (its loading message, its start-up preload) on ``MTAD_ENGINE=compiled``
    and on ``auto``, never on ``eager``; its status line names the models that run compiled."""
    from mtad.models.pair import load
    from mtad.ui.pickers import pair_facts
    from mtad.ui.run import compiled_engine

    monkeypatch.setenv("MTAD_ENGINE", "eager")
    assert not compiled_engine()
    monkeypatch.setenv("MTAD_ENGINE", "compiled")
    assert compiled_engine()
    monkeypatch.delenv("MTAD_ENGINE")
    assert compiled_engine()
    assert "compiled target and draft (torch" in pair_facts(load(*tiny_dirs, device="cpu", engine="compiled"))
    assert "compiled" not in pair_facts(load(*tiny_dirs, device="cpu", engine="eager"))


def test_the_page_s_pairs_load_compiled_and_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``MTAD_ENGINE=compiled`` the page's pair cache loads the pair on the compiled engine and compiles
    every one-row shape the page can ask for (γ up to its maximum) before a visitor's run: none recompiles."""
    from mtad.ui.runner import PairCache

    monkeypatch.setenv("MTAD_ENGINE", "compiled")
    cache = PairCache(1)
    cache.preload("embedded").join()
    pair = cache.peek("embedded")
    assert pair is not None and pair.engine == "compiled"
    top = int(PARAMS["gamma"].widget_range[1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for method, gamma in (("ar", 1), ("sd", top), ("mtad", top)):
            run = generate(pair, "abc def", Settings(method=method, gamma=gamma, max_new_tokens=40, seed=1))
            assert len(run.new_ids) > 0


def test_a_pair_that_fails_to_compile_serves_on_the_eager_engine(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A compiler failing at the page's warm-up (seen: a truncated library in inductor's on-disk cache) leaves
    the pair on the eager engine, with a warning, instead of failing every visitor's run."""
    from mtad.ui import runner

    def broken(pair, tokens):  # noqa: ANN001, ANN202
        raise ImportError("/tmp/torchinductor_root/x.main.so: file too short")

    monkeypatch.setenv("MTAD_ENGINE", "compiled")
    monkeypatch.setattr(runner, "warm_up_pair", broken)
    with caplog.at_level("WARNING", logger=runner.log.name):
        pair = runner.PairCache(1).get("embedded")
    assert pair.engine == "eager"
    assert "compiling embedded failed; it runs on the eager engine" in caplog.text
    assert "ImportError: /tmp/torchinductor_root/x.main.so: file too short" in caplog.text  # with its traceback
    assert generate(pair, "abc def", Settings(max_new_tokens=8)).new_ids


WARM_AND_GENERATE = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from mtad.decoding import generate
from mtad.decoding.precompile import warm_up_pair
from mtad.models.pair import load
from mtad.settings import Settings
pair = load(sys.argv[1], sys.argv[2], device="cpu", dtype="float32", engine="compiled")
warm_up_pair(pair, 1)
print(generate(pair, "abc def", Settings(max_new_tokens=6, greedy=True)).new_ids)
"""


def test_a_library_truncated_in_inductor_s_cache_is_compiled_again(tiny_dirs, tmp_path) -> None:
    """A compile killed mid-write leaves a zero-byte library in inductor's on-disk cache; the next process
    fails to load it (or to build against it), throws that cache away, compiles anew with a warning and
    decodes as before, and the cache is whole again for the one after."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", WARM_AND_GENERATE, *tiny_dirs], env=env, capture_output=True, text=True, timeout=600
        )

    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    libraries = list((tmp_path / "inductor").rglob("*.so"))
    assert libraries
    for lib in libraries:
        lib.write_bytes(b"")
    second = run()
    assert second.returncode == 0, second.stderr[-2000:]
    assert "compiling from inductor's on-disk cache failed" in second.stderr  # then compiled anew
    assert "compiling from inductor's on-disk cache failed" not in first.stderr
    assert second.stdout == first.stdout
    rebuilt = list((tmp_path / "inductor").rglob("*.so"))
    assert rebuilt and all(lib.stat().st_size > 0 for lib in rebuilt)
    assert [p.name for p in tmp_path.iterdir()] == ["inductor"]  # nothing set aside is left behind


SECOND_MODEL_SYMBOLS = """
import json, logging, sys
import torch
sys.path.insert(0, sys.argv[1])
from conftest import make_model
from mtad.decoding.static_lm import StaticLM
made = []
class Symbols(logging.Handler):
    def emit(self, record):
        text = record.getMessage()
        source = text.split(" for ", 1)[-1].split(" ", 1)[0]
        if text.startswith("create_symbol") and "size()" in source:  # a tensor's dimension, not a scalar
            made.append(source)
shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
shapes.setLevel(logging.INFO)
shapes.addHandler(Symbols())
seen = []
for hidden in (32, 48):
    made.clear()
    lm = StaticLM(make_model(97, hidden, 2, seed=0), 97)
    lm.feed(torch.tensor([[1, 2, 3]]))
    for n in (1, 2, 1):
        lm.feed(torch.ones((1, n), dtype=torch.long), keep=n)
        lm.rollback(3)
    seen.append(sorted(set(made)))
print(json.dumps(seen))
"""


def test_a_second_model_compiles_the_same_static_shapes_as_the_first(tmp_path) -> None:
    """Two models of other widths in one process (the page's two pairs): the second's forwards compile for
    its own shapes, not into graphs generic in every dimension that differed. Dynamo's automatic dynamic
    shapes made them generic: SmolLM2's one-token forward after the embedded pair's took 215 ms, not 18.
    The second model's tensors have the first's symbolic dimensions (the cache's capacity, the mask's span,
    the token count), no more."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SECOND_MODEL_SYMBOLS, str(ROOT / "tests")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = json.loads(done.stdout.splitlines()[-1])
    assert first and any("mask" in source or "[3]" in source for source in first)  # the span: symbols are seen
    assert second == first


def test_only_a_failure_that_names_a_cached_file_discards_the_cache(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "inductor"
    (cache / "ab").mkdir(parents=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    assert discard_broken_cache(RuntimeError("C++ compile error: g++ not found")) is None
    assert (cache / "ab").is_dir()
    try:
        raise RuntimeError("backend compiler failed") from ImportError(f"{cache}/ab/x.main.so: file too short")
    except RuntimeError as exc:
        assert discard_broken_cache(exc) == f"{cache}/ab/x.main.so: file too short"
    assert not cache.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("kernel", ["mkl", "onednn"])
def test_both_product_layouts_compiled_equal_a_full_recompute(tiny_pair, kernel: str) -> None:
    """Plain matrices (seven products a layer) and oneDNN-packed ones (q, k, v fused, gate and up fused),
    compiled: the logits of one token and of a block equal a full recompute."""
    if kernel == "onednn" and "onednn" not in candidates(torch.float32):
        pytest.skip("needs PyTorch's oneDNN (mkldnn) build")
    model = copy.deepcopy(tiny_pair.target)
    use_linear_kernel(model, kernel)
    ids = tiny_pair.encode("abc def gh abba cafe")
    lm = StaticLM(model, tiny_pair.vocab_size)
    lm.feed(torch.tensor([ids[:-5]]))
    one = lm.feed(torch.tensor([ids[-5:-4]]))[0, -1]
    torch.testing.assert_close(one, full_logits(tiny_pair.target, ids[:-4]), rtol=1e-4, atol=1e-4)
    block = lm.feed(torch.tensor([ids[-4:]]), keep=4)[0]
    for j in range(4):
        expected = full_logits(tiny_pair.target, ids[: len(ids) - 3 + j])
        torch.testing.assert_close(block[j], expected, rtol=1e-4, atol=1e-4)
    assert lm.layers[0][1] == ("packed" if kernel == "onednn" else "plain")
    eager = model(input_ids=torch.tensor([ids])).logits[0, -1]  # the layers' own packed copies come back
    torch.testing.assert_close(eager, full_logits(tiny_pair.target, ids), rtol=1e-4, atol=1e-4)


def products_run(lm: StaticLM, tokens: list[list[int]], keep: int = 1) -> tuple[torch.Tensor, set[str]]:
    """``lm.feed(tokens)``'s logits and which of the engine's product operators ran in it."""
    ours = {"mtad::packed_linear", "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"}
    ours |= {"aten::linear", "aten::matmul", "aten::bmm"}
    with torch.profiler.profile() as prof:
        logits = lm.feed(torch.tensor(tokens), keep=keep)
    return logits, {e.name for e in prof.events()} & ours


def gemv_up_to(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """Have every dtype's one-row forwards of up to ``tokens`` tokens take the ``gemv`` form, whatever this
    CPU's own table says (:func:`mtad.models.static_llama.gemv_tokens`)."""
    for where in ("mtad.models.static_llama", "mtad.decoding.static_lm"):
        monkeypatch.setattr(f"{where}.gemv_tokens", lambda dtype: tokens)


ONEDNN_REASON = {
    torch.float32: "needs PyTorch built with oneDNN",
    torch.bfloat16: "needs a CPU with oneDNN's bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT), not capped below it",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_row_forward_of_a_few_tokens_streams_each_matrix_inside_the_compiled_graph(
    monkeypatch: pytest.MonkeyPatch, tiny_pair, dtype: torch.dtype
) -> None:
    """One row of up to gemv_tokens tokens (AR's step, SD's drafting; a verification where the CPU's few-row
    products are slow) multiplies by the layers' own matrices and the output head's as reductions inductor
    generates, attention too for one token, no product operator called, and gives the full recompute's
    logits (fp32), or bf16 logits as close to them as the packed products'; a product whose input is
    larger than GEMV_INPUT_BYTES (the down projection's, wider than the rest) takes the packed product; a
    longer block and several rows keep oneDNN's packed products. (Attention over several queries keeps
    its batched products.)"""
    if "onednn" not in candidates(dtype):
        pytest.skip(ONEDNN_REASON[dtype])
    gemv_up_to(monkeypatch, 3)
    model = copy.deepcopy(tiny_pair.target).to(dtype)
    use_linear_kernel(model, "onednn")
    ids = tiny_pair.encode("abc def gh abba cafe")
    lm, packed = StaticLM(model, tiny_pair.vocab_size), StaticLM(model, tiny_pair.vocab_size)
    packed.one_row = None
    assert {form for _, form, _ in lm.one_row} == {"gemv"} and lm.one_row_tokens == 3
    assert lm.one_row[0][0][2] is model.model.layers[0].self_attn.q_proj.weight  # the layer's own, no copy
    start = len(ids) - 6
    lm.feed(torch.tensor([ids[:start]])), packed.feed(torch.tensor([ids[:start]]))

    def check(got: torch.Tensor, tokens: list[int], past: int) -> None:
        """fp32: the full recompute's logits; bf16: as close to them as the packed products' (which round
        in other places)."""
        exact = torch.stack([full_logits(tiny_pair.target, ids[: past + j + 1]) for j in range(len(tokens))])
        if dtype == torch.float32:
            torch.testing.assert_close(got[0], exact, rtol=1e-4, atol=1e-4)
        else:
            ref = packed.feed(torch.tensor([tokens]), keep=len(tokens))[0]
            err, ref_err = (got[0] - exact).abs().max(), (ref - exact).abs().max()
            assert err <= 2 * ref_err + 0.02, (len(tokens), err, ref_err)

    for i in range(start, start + 3):
        one, ran = products_run(lm, [[ids[i]]])
        assert not ran, ran
        check(one, [ids[i]], i)
    for n in (2, 3):
        lm.rollback(start), packed.rollback(start)
        block, ran = products_run(lm, [ids[start : start + n]], keep=n)
        assert not ran - {"aten::bmm", "aten::matmul"}, (n, ran)  # several queries: attention's batched products
        check(block, ids[start : start + n], start)
    lm.rollback(start), packed.rollback(start)  # an input larger than the bound: that product packed
    monkeypatch.setattr("mtad.models.static_llama.GEMV_INPUT_BYTES", 3 * model.config.hidden_size * dtype.itemsize)
    lm.feed(torch.tensor([ids[start : start + 3]]), keep=3), lm.rollback(start)  # compiled before it is counted
    with torch.profiler.profile() as prof:
        block = lm.feed(torch.tensor([ids[start : start + 3]]), keep=3)
    assert [e.name for e in prof.events()].count("mtad::packed_linear") == len(model.model.layers)  # down's
    check(block, ids[start : start + 3], start)
    lm.rollback(start)
    _, ran = products_run(lm, [ids[start : start + 4]], keep=4)
    assert "mtad::packed_linear" in ran
    lm.cache.fan_out(2)
    _, ran = products_run(lm, [[ids[-1]], [ids[-2]]])
    assert "mtad::packed_linear" in ran


def test_how_many_tokens_of_one_row_take_the_gemv_form(monkeypatch: pytest.MonkeyPatch, micro_int8_pair) -> None:  # noqa: F811
    """What was measured faster: fp32 one token, up to six where PyTorch runs AVX2 code; bf16 one token where
    the CPU has AVX512-BF16 without AMX, none elsewhere; fp16 none. An int8 layer keeps its int8 or
    dequantised products."""
    from mtad.models import static_llama

    cases = (
        ("AVX2", {"avx2"}, (6, 0)),
        ("AVX2", {"avx2", "avx512_bf16"}, (6, 1)),  # AVX-512 hardware run as AVX2: its bf16 is still native
        ("AVX512", {"avx512_f", "avx512_bf16"}, (1, 1)),
        ("AVX512", {"avx512_bf16", "amx_bf16", "amx_tile"}, (1, 0)),
        ("DEFAULT", set(), (1, 0)),
    )
    for capability, flags, (fp32, bf16) in cases:
        monkeypatch.setattr(static_llama, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        static_llama.gemv_tokens.cache_clear()
        got = [static_llama.gemv_tokens(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
        assert got == [fp32, bf16, 0], capability
    monkeypatch.undo()
    static_llama.gemv_tokens.cache_clear()  # this CPU's own answer again
    draft = micro_int8_pair.draft
    assert static_llama.gemv_layer_weights(draft.model.layers[0]) is None
    lm = StaticLM(draft, micro_int8_pair.vocab_size)
    if int8_kernel_input(torch.float32) is None:  # fp32 int8: the dequantised products
        assert lm.one_row is None and lm.one_row_tokens == 0
    else:  # fp32 rounded to bf16 for the int8 kernel, one token
        assert {form for _, form, _ in lm.one_row} == {"int8"} and lm.one_row_tokens == 1


def test_greedy_decoders_verifying_in_the_gemv_form_equal_greedy_ar(
    monkeypatch: pytest.MonkeyPatch, close_pair
) -> None:
    """Where a verification of γ + 1 tokens takes the gemv form (an AVX2 CPU in fp32), greedy SD and MTAD
    on the compiled engine write greedy AR's text, as on the eager engine, and a second prompt recompiles
    nothing."""
    gemv_up_to(monkeypatch, 6)
    compiled = dataclasses.replace(close_pair, engine="compiled")
    torch._dynamo.reset()
    for prompt in ("abc def", "abc def gh abc bad cafe fed"):
        ar = generate(close_pair, prompt, GREEDY[0]).new_ids
        for settings in (GREEDY[1], GREEDY[2], dataclasses.replace(GREEDY[1], gamma=5)):
            with torch._dynamo.config.patch(error_on_recompile=prompt != "abc def"):
                got = generate(compiled, prompt, settings).new_ids
            assert got == generate(close_pair, prompt, settings).new_ids, settings
            if settings.method == "sd":
                assert got == ar, settings
    st = DecodeState.start(compiled, close_pair.encode("abc"), GREEDY[1])
    assert st.target.one_row is not None and st.target.one_row_tokens == 6


def test_the_bench_records_how_each_model_multiplies(tiny_pair, micro_int8_pair) -> None:  # noqa: F811
    """``bench.json``'s environment names each compiled model's products, in one row up to some tokens and
    otherwise: the gemv form for an fp32 model, the int8 kernel for an int8 draft's one token in bf16 (and
    in fp32 where :func:`~mtad.models.shortlist_draft.int8_kernel_input` rounds it to bf16);
    nothing on the eager engine."""
    from mtad.bench.report import environment
    from mtad.decoding.static_lm import products
    from mtad.models.static_llama import gemv_tokens, layer_weights

    pair = dataclasses.replace(tiny_pair, engine="compiled")
    several = layer_weights(pair.target.model.layers[0])[1]
    assert several in ("packed", "plain")
    want = {"one_row": "gemv", "one_row_tokens": gemv_tokens(torch.float32), "several": several}
    assert products(pair)["target"] == want
    assert environment(pair, [], None, "none", None)["compiled_products"] == products(pair)
    assert products(dataclasses.replace(tiny_pair, engine="eager")) == {}
    int8 = dataclasses.replace(micro_int8_pair, engine="compiled")
    draft = products(int8)["draft"]
    if int8_kernel_input(torch.float32) is None:  # fp32 int8 layers: their dequantised products
        assert draft["one_row"] == draft["several"] != "gemv" and draft["one_row_tokens"] == 0
    else:  # one row rounded to bf16 for the int8 kernel
        assert draft["one_row"] == "int8" != draft["several"] and draft["one_row_tokens"] == 1
    int8 = dataclasses.replace(int8, draft=copy.deepcopy(micro_int8_pair.draft).to(torch.bfloat16))
    assert products(int8)["draft"]["one_row"] == "int8" and products(int8)["draft"]["one_row_tokens"] == 1


@pytest.mark.parametrize("kernel", ["mkl", "onednn"])
def test_an_int8_shortlist_draft_on_the_compiled_engine_equals_its_eager_forward(
    micro_int8_pair,  # noqa: F811
    kernel: str,
) -> None:
    """A shortlist draft with int8 layers runs compiled (its layers are Llama layers over dequantised
    matrices): logits over its shortlist and over the whole vocabulary (-inf off the shortlist) equal the
    eager draft's, for one row, a block and fanned-out, reordered beams; greedy SD and MTAD on the compiled
    pair equal greedy AR."""
    if kernel == "onednn" and "onednn" not in candidates(torch.float32):
        pytest.skip("needs PyTorch's oneDNN (mkldnn) build")
    pair = dataclasses.replace(micro_int8_pair, draft=copy.deepcopy(micro_int8_pair.draft), engine="compiled")
    use_linear_kernel(pair.draft, kernel)
    static, eager = draft_lm(pair), CachedLM(pair.draft, pair.vocab_size)
    assert isinstance(static, StaticLM) and static.layers[0][1] == ("packed" if kernel == "onednn" else "plain")
    ids = [1, 2, 9, 3, 4, 8, 5, 6, 2]
    feed_both(eager, static, [ids[:5]])
    for columns in (True, False):  # one token, then a block of three, each rolled back
        for block in ([ids[5]], ids[5:8]):
            got = static.feed(torch.tensor([block]), keep=len(block), columns=columns)
            want = eager.feed(torch.tensor([block]), keep=len(block), columns=columns)
            assert got.shape[-1] == (6 if columns else pair.vocab_size)
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            torch.testing.assert_close(got.nan_to_num(0, 0, 0), want.nan_to_num(0, 0, 0), rtol=1e-4, atol=1e-4)
            for lm in (static, eager):
                lm.rollback(5)
    for lm in (static, eager):
        lm.cache.fan_out(3)
    for step in ([[1], [2], [3]], [[4], [5], [6]]):
        got = static.feed(torch.tensor(step), columns=True)
        torch.testing.assert_close(got, eager.feed(torch.tensor(step), columns=True), rtol=1e-4, atol=1e-4)
        for lm in (static, eager):
            lm.cache.reorder(torch.tensor([1, 1, 0]))
    ar = generate(pair, "abcab", Settings(method="ar", greedy=True, max_new_tokens=20)).new_ids
    for method in ("sd", "mtad"):
        s = Settings(method=method, greedy=True, tau=1.0 if method == "mtad" else 0.1, beams=3, max_new_tokens=20)
        assert generate(pair, "abcab", s).new_ids == ar, method


def test_an_int8_draft_s_one_row_bf16_forward_multiplies_with_the_int8_kernel_on_both_engines(
    micro_int8_pair,  # noqa: F811
) -> None:
    """In bf16 on a CPU an int8 draft's one-token, one-row forward reads its int8 matrices on the compiled
    engine as on the eager one (half the bytes of its dequantised bf16 matrices): the compiled logits equal
    the eager ones to bf16 rounding, and the product operator equals the int8 layer it stands for exactly;
    several rows keep the dequantised matrices. fp32 does the same where its row enters the kernel rounded to
    bf16 (:func:`~mtad.models.shortlist_draft.int8_kernel_input`), else keeps the dequantised matrices."""
    from mtad.models.shortlist_draft import Int8Linear
    from mtad.models.static_llama import int8_layer_weights, int8_linear

    draft = copy.deepcopy(micro_int8_pair.draft).to(torch.bfloat16)
    layer = draft.model.layers[0]
    fp32 = int8_layer_weights(micro_int8_pair.draft.model.layers[0])
    assert (fp32 is None) == (int8_kernel_input(torch.float32) is None)
    weights, form, widths = int8_layer_weights(layer)
    assert form == "int8" and weights[2].dtype == torch.int8 and weights[3].dtype == torch.bfloat16
    x = torch.randn(1, 1, draft.config.hidden_size, dtype=torch.bfloat16)
    proj = layer.self_attn
    with torch.inference_mode():
        qkv = int8_linear(x, weights[2], weights[3], sum(widths[:3]))
        eager = torch.cat([proj.q_proj(x), proj.k_proj(x), proj.v_proj(x)], dim=-1)
    assert isinstance(proj.q_proj, Int8Linear) and torch.equal(qkv, eager)
    static, cached = StaticLM(draft, micro_int8_pair.vocab_size), CachedLM(draft, micro_int8_pair.vocab_size)
    assert static.one_row is not None and static.one_row_tokens == 1
    ids = torch.tensor([[1, 2, 9, 3, 4]])
    static.feed(ids), cached.feed(ids)
    for token in (5, 6, 2):
        with torch.profiler.profile() as prof:
            got = static.feed(torch.tensor([[token]]), columns=True)
        torch.testing.assert_close(got, cached.feed(torch.tensor([[token]]), columns=True), rtol=5e-2, atol=1e-1)
        assert any(e.name == "aten::_weight_int8pack_mm" for e in prof.events()), "the int8 kernel did not run"
    static.cache.fan_out(2)
    with torch.profiler.profile() as prof:
        static.feed(torch.tensor([[5], [6]]), columns=True)
    assert not any(e.name == "aten::_weight_int8pack_mm" for e in prof.events())
    if fp32 is None:
        return
    draft = micro_int8_pair.draft  # fp32, its one row rounded to bf16 for the kernel
    assert fp32[1] == "int8" and fp32[0][2].dtype == torch.int8 and fp32[0][3].dtype == torch.bfloat16
    static, cached = StaticLM(draft, micro_int8_pair.vocab_size), CachedLM(draft, micro_int8_pair.vocab_size)
    static.feed(ids), cached.feed(ids)
    for token in (5, 6):
        with torch.profiler.profile() as prof:
            got = static.feed(torch.tensor([[token]]), columns=True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, cached.feed(torch.tensor([[token]]), columns=True), rtol=5e-2, atol=1e-1)
        assert any(e.name == "aten::_weight_int8pack_mm" for e in prof.events()), "the int8 kernel did not run"


def embedded_and_headed(lm: StaticLM, tokens: list[list[int]], keep: int = 1) -> tuple[torch.Tensor, list[str]]:
    """``lm.feed(tokens)``'s logits (over its columns) and the names of the operators that ran outside a compiled
    graph's own kernels, once the forward is compiled (a first call compiles it, then is taken back)."""
    lm.feed(torch.tensor(tokens), keep=keep)
    lm.rollback(lm.length - len(tokens[0]))
    with torch.profiler.profile() as prof:
        logits = lm.feed(torch.tensor(tokens), keep=keep, columns=True)
    return logits, [e.name for e in prof.events()]


EAGER_ENDS = {"aten::embedding", "aten::cos", "aten::rsqrt", "aten::linear", "aten::mm"}
"""Operators that run outside a compiled graph when a forward's embedding, rotary tables, final norm or head
do (inside, inductor generates them)."""


def test_a_compiled_forward_embeds_in_its_first_call_and_applies_its_head_in_its_last(
    monkeypatch: pytest.MonkeyPatch,
    tiny_pair,
) -> None:
    """On the compiled engine a model whose layers fit one compiled call runs its embedding, rotary tables,
    final norm and head in it (no call of their own): the tiny target gives the full recompute's fp32 logits;
    several tokens multiply a oneDNN head, prepacked, in the graph too. A model of several calls applies only
    the ``gemv`` form's head in its last, and a head tied to the embedding, in the call that embeds, leaves the
    embedding eager."""
    gemv_up_to(monkeypatch, 1)
    ids = tiny_pair.encode("abc def gh abba cafe")
    for most, eager in ((6, set()), (1, {"aten::embedding", "aten::cos"})):  # one call of two layers, or two
        monkeypatch.setattr("mtad.models.static_llama.MOST_LAYERS_PER_CALL", most)
        lm = StaticLM(tiny_pair.target, tiny_pair.vocab_size)
        lm.feed(torch.tensor([ids[:-3]]))
        for i in range(len(ids) - 3, len(ids)):
            logits, ran = embedded_and_headed(lm, [[ids[i]]])
            expected = full_logits(tiny_pair.target, ids[: i + 1])
            torch.testing.assert_close(logits[0, -1], expected, rtol=1e-4, atol=1e-4)
            assert EAGER_ENDS & set(ran) == eager, ran
    monkeypatch.setattr("mtad.models.static_llama.MOST_LAYERS_PER_CALL", 6)
    packed = copy.deepcopy(tiny_pair.target)
    use_linear_kernel(packed, "onednn")
    lm = StaticLM(packed, tiny_pair.vocab_size)
    assert lm.layers[0][1] == "packed"
    lm.feed(torch.tensor([ids[:-3]]))
    block, ran = embedded_and_headed(lm, [ids[-3:]], keep=3)  # three tokens: the packed form and head
    for j in range(3):
        expected = full_logits(tiny_pair.target, ids[: len(ids) - 2 + j])
        torch.testing.assert_close(block[0, j], expected, rtol=1e-4, atol=1e-4)
    assert not EAGER_ENDS & set(ran), ran
    tied = copy.deepcopy(tiny_pair.target)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    lm = StaticLM(tied, tiny_pair.vocab_size)
    lm.feed(torch.tensor([ids[:-1]]))
    logits, ran = embedded_and_headed(lm, [[ids[-1]]])
    torch.testing.assert_close(logits[0, -1], full_logits(tied, ids), rtol=1e-4, atol=1e-4)
    assert "aten::embedding" in ran


@needs_onednn_bf16
def test_an_int8_draft_s_compiled_bf16_forward_keeps_its_products_in_the_graph(
    monkeypatch: pytest.MonkeyPatch,
    micro_int8_pair,  # noqa: F811
) -> None:
    """An int8 draft's one-row bf16 forward multiplies its layers and its shortlist head with the int8 kernel
    in one compiled call, with its eager engine's logits; several rows multiply the dequantised matrices,
    prepacked for oneDNN, in the graph too."""
    gemv_up_to(monkeypatch, 1)
    if int8_kernel_input(torch.bfloat16) is None:
        pytest.skip("needs a CPU whose int8-weight kernel takes bf16 rows")
    draft = copy.deepcopy(micro_int8_pair.draft).to(torch.bfloat16)
    static, cached = StaticLM(draft, micro_int8_pair.vocab_size), CachedLM(draft, micro_int8_pair.vocab_size)
    start = torch.tensor([[1, 2, 9, 3, 4]])
    static.feed(start), cached.feed(start)
    for token in (5, 6, 2):
        got, ran = embedded_and_headed(static, [[token]])
        torch.testing.assert_close(got, cached.feed(torch.tensor([[token]]), columns=True), rtol=5e-2, atol=1e-1)
        assert not EAGER_ENDS & set(ran), ran
        assert ran.count("aten::_weight_int8pack_mm") == 4 * len(draft.model.layers) + 1  # the head's too
    use_linear_kernel(draft, "onednn")  # several rows multiply by the dequantised matrices, prepacked
    static, cached = StaticLM(draft, micro_int8_pair.vocab_size), CachedLM(draft, micro_int8_pair.vocab_size)
    static.feed(start), cached.feed(start)
    static.cache.fan_out(2)
    got, ran = embedded_and_headed(static, [[5], [5]])
    expected = cached.feed(torch.tensor([[5]]), columns=True)
    torch.testing.assert_close(got, expected.expand(2, -1, -1), rtol=5e-2, atol=1e-1)
    assert not EAGER_ENDS & set(ran) and "aten::_weight_int8pack_mm" not in ran, ran


@pytest.mark.parametrize(
    ("rope", "inside"),
    [
        ({"rope_type": "default"}, True),
        ({"rope_type": "linear", "factor": 2.0}, True),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}, True),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, True),
        ({"rope_type": "dynamic", "factor": 2.0}, False),
    ],
)  # fmt: skip
def test_the_graph_s_embedding_and_rotary_tables_are_the_model_s_own(rope: dict, inside: bool) -> None:
    """:func:`~mtad.models.static_llama.embed` gives the model's own embedding and rotary tables, to the bit in
    fp32, for every rotary kind whose frequencies are fixed (yarn's with its attention scaling); a kind that
    recomputes them from the length (dynamic) keeps the model's own module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtad.models.static_llama import embed, start_of

    config = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_parameters={"rope_theta": 10000.0, **rope},
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    start = start_of(model)
    assert (start is not None) == inside
    if not inside:
        return
    ids, positions = torch.tensor([[3, 7, 39, 0]]), torch.tensor([0, 5, 90, 200])
    h, cos, sin = embed(ids, positions, start)
    own_cos, own_sin = model.model.rotary_emb(h, positions.view(1, -1))
    assert torch.equal(h, model.model.embed_tokens(ids))
    assert torch.equal(cos, own_cos.unsqueeze(1)) and torch.equal(sin, own_sin.unsqueeze(1))
    if rope["rope_type"] == "yarn":
        assert start[3] != 1.0


ONE_ENGINE_RUN = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtad.decoding.kv import CachedLM
from mtad.decoding.static_lm import StaticLM
from mtad.decoding.precompile import WARMED, needs_warm_up, warm_up_pair, warm_up_settings
from mtad.models.kernels import use_linear_kernel

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
)
model = LlamaForCausalLM(config).eval()
use_linear_kernel(model, "onednn" if torch.backends.mkldnn.is_available() else "mkl")
static, eager = StaticLM(model, 64), CachedLM(model, 64)
ids = torch.randint(0, 64, (1, 16))
static.feed(ids[:, :8]), eager.feed(ids[:, :8])
for i in range(8, 12):
    torch.testing.assert_close(static.feed(ids[:, i : i + 1]), eager.feed(ids[:, i : i + 1]), rtol=1e-4, atol=1e-4)
static.rollback(8), eager.rollback(8)
for n in (4, 8):  # verifications: AVX2 runs four tokens of one row in the gemv form, eight packed
    block = ids[:, 8 : 8 + n]
    torch.testing.assert_close(static.feed(block, keep=n), eager.feed(block, keep=n), rtol=1e-4, atol=1e-4)
    static.rollback(8), eager.rollback(8)
print("compiled logits equal the eager ones")
"""


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU (to run it as an AVX2 one too)"
)
def test_code_compiled_for_one_cpu_capability_is_not_reused_under_another(tmp_path) -> None:  # noqa: ANN001
    """Inductor's on-disk cache keys leave out a capability forced with ``ATEN_CPU_CAPABILITY``: code cached
    by an AVX-512 run, loaded by an AVX2 run on the same machine (how the journal emulates an AVX2-only
    CPU), gave wrong logits or corrupted the heap, and the other way round. The engine keeps one cache
    folder per capability: two fresh processes on one ``TORCHINDUCTOR_CACHE_DIR``, AVX-512 then AVX2,
    both give the eager engine's logits."""
    import os
    import subprocess
    import sys

    for capability in ("avx512", "avx2"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", ONE_ENGINE_RUN], env=env, capture_output=True, text=True)
        assert done.returncode == 0 and "logits equal" in done.stdout, (capability, done.stderr[-3000:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-avx2", "cpu-avx512"]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("n", [4, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_attention_over_strided_buffers_equals_the_fused_kernel(
    dtype: torch.dtype, n: int, compiled: bool
) -> None:
    """The few-query attention (bf16 computes its scores as K q^T, fp32 as q K^T; one query a row, compiled,
    as two reductions) over the first slots of buffers with room to spare, in several rows and grouped heads,
    with a masked slot, equals PyTorch's fused attention over the same keys and values made contiguous."""
    gen = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, d, capacity, span = 3, 6, 2, 16, 64, 37
    q = torch.randn(rows, heads, n, d, generator=gen).to(dtype)
    k_buf = torch.randn(rows, kv_heads, capacity, d, generator=gen).to(dtype)
    v_buf = torch.randn(rows, kv_heads, capacity, d, generator=gen).to(dtype)
    mask = torch.ones(n, span, dtype=torch.bool).tril(diagonal=span - n)
    mask[:, 5] = False  # a slot no query attends (a rejected draft's, in a tree)
    attend = torch.compile(_attention, fullgraph=True) if compiled else _attention
    with torch.inference_mode():
        ours = attend(q, k_buf, v_buf, mask, 0.25)
    fused = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k_buf[:, :, :span].float(), v_buf[:, :, :span].float(), attn_mask=mask, scale=0.25, enable_gqa=True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), fused, rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_a_few_queries_as_reductions_equal_the_fused_kernel(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The few-query reductions (bf16's verification; here forced in fp32 to compare at 1e-5), compiled, over
    strided buffers with a masked slot, equal PyTorch's fused attention; past their query count the batched
    products take over."""
    from mtad.models import static_llama

    monkeypatch.setattr(static_llama, "REDUCED_QUERY_DTYPES", (torch.float32,))
    taken, reduce = [], static_llama._few_query_attention

    def counted(*args: torch.Tensor | float) -> torch.Tensor:
        taken.append(args[0].shape[2])
        return reduce(*args)

    monkeypatch.setattr(static_llama, "_few_query_attention", counted)
    gen = torch.Generator().manual_seed(n)
    rows, heads, kv_heads, d, capacity, span = 2, 6, 2, 16, 64, 30
    q = torch.randn(rows, heads, n, d, generator=gen)
    k_buf, v_buf = torch.randn(2, rows, kv_heads, capacity, d, generator=gen)
    mask = torch.ones(n, span, dtype=torch.bool).tril(diagonal=span - n)
    mask[:, 3] = False
    with torch.inference_mode():
        ours = torch.compile(_attention, fullgraph=True)(q, k_buf, v_buf, mask, 0.25)
        nine = q[:, :, :1].expand(-1, -1, 9, -1).contiguous()
        more = torch.compile(_attention, fullgraph=True)(nine, k_buf, v_buf, mask[:1].expand(9, -1), 0.25)
    fused = torch.nn.functional.scaled_dot_product_attention(
        q, k_buf[:, :, :span], v_buf[:, :, :span], attn_mask=mask, scale=0.25, enable_gqa=True
    )
    torch.testing.assert_close(ours, fused, rtol=1e-5, atol=1e-5)
    assert taken == [n] and more.shape[2] == 9  # nine queries: the batched products, not the reductions


def limit_hits() -> int:
    """How often dynamo has run a frame uncompiled for hitting a graph limit, from its own counters."""
    return sum(n for why, n in torch._dynamo.utils.counters["unimplemented"].items() if "recompile limit" in why)


def test_a_thread_compiles_past_dynamo_s_default_of_eight_graphs(monkeypatch: pytest.MonkeyPatch, tiny_pair) -> None:
    """Dynamo's graph limits are per thread: a forward compiled in another thread (the page's loading and
    lane threads) keeps more than its default 8 graphs of one function, here twelve token counts of the
    ``gemv`` form, and none runs uncompiled."""
    import threading

    from mtad.decoding.static_lm import compile_shapes

    gemv_up_to(monkeypatch, 12)
    torch._dynamo.reset()
    hits, errors = limit_hits(), []
    frames = torch._dynamo.utils.counters["frames"]
    total, ok = frames["total"], frames["ok"]  # the process's counts so far (other tests' frames among them)

    def compile_twelve() -> None:
        try:
            assert torch._dynamo.config.recompile_limit == 8  # dynamo's default in a fresh thread
            compile_shapes(tiny_pair.target, tiny_pair.vocab_size, 12)
        except BaseException as exc:  # noqa: BLE001  (reported below, in the test's thread)
            errors.append(exc)

    worker = threading.Thread(target=compile_twelve)
    worker.start()
    worker.join()
    assert not errors, errors
    assert limit_hits() == hits
    assert frames["total"] - total == frames["ok"] - ok >= 12  # every frame of this thread compiled
