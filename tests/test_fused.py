"""The bookkeeping compiled on GPUs (``mtad.decoding.fused``), compiled here on the CPU: one graph each (no
host read), the same results as the code as written, the same texts and one host read an iteration when
every decoder runs it compiled, and new settings as inputs to the same graph rather than new graphs."""

from __future__ import annotations

import dataclasses
import math
import types
from collections import Counter

import pytest
import torch
from test_syncs import host_reads
from torch._dynamo.testing import CompileCounterWithBackend

from mtad.bench.report import environment
from mtad.decoding import DECODERS, decode, fused
from mtad.decoding.draft_distributions import DraftDistributions
from mtad.decoding.iteration import sample_rows
from mtad.decoding.mtad import beam_step, mtad_rule
from mtad.decoding.precompile import warm_up_pair
from mtad.decoding.rules import log_tau
from mtad.decoding.speculative import sd_rule
from mtad.decoding.state import DecodeState
from mtad.models.pair import ModelPair
from mtad.sampling import RowDistributions, Warp, log_probs, sample_logits
from mtad.settings import Settings

SAMPLING = Settings(method="mtad", temperature=0.9, top_k=20, top_p=0.9)
GREEDY = Settings(method="mtad", greedy=True)
VOCAB = 3000


def warp_of(settings: Settings) -> Warp:
    """The distribution as a generation on the compiled bookkeeping holds it: its values 0-d tensors."""
    return Warp.of(settings, torch.device("cpu"))


def threshold(tau: float) -> torch.Tensor:
    return torch.tensor(log_tau(tau), dtype=torch.float64)


def logits_with_ties(rows: int, seed: int) -> torch.Tensor:
    """fp32 logits rounded through bf16, as a bf16 model's are: the k-th largest is often tied."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=g) * 3).bfloat16().float()


def same(eager: tuple, compiled: tuple) -> None:
    """Integer results equal, floating ones to rounding (the compiled kernels sum in their own order)."""
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled, strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)


def compile_bookkeeping(monkeypatch: pytest.MonkeyPatch, on: bool = True) -> None:
    """Generations run the fused functions compiled (``on``), here on the CPU, as on a GPU's compiled engine."""
    monkeypatch.setattr("mtad.decoding.state.fused_enabled", lambda pair: on)


@pytest.fixture
def compiled_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    compile_bookkeeping(monkeypatch)


def test_the_bookkeeping_runs_compiled_on_a_gpu_s_compiled_engine_only(
    monkeypatch: pytest.MonkeyPatch, close_pair: ModelPair
) -> None:
    on = dataclasses.replace(close_pair, engine="compiled", device=torch.device("cuda"))
    assert fused.fused_enabled(on)
    assert not fused.fused_enabled(dataclasses.replace(on, engine="eager"))
    assert not fused.fused_enabled(dataclasses.replace(on, device=torch.device("cpu")))
    monkeypatch.setenv("MTAD_FUSED", "0")
    assert not fused.fused_enabled(on)
    assert not DecodeState.start(close_pair, [1, 2], Settings()).fused
    assert environment(close_pair, [], None, "none", None)["bookkeeping"] == "as written"
    monkeypatch.setattr("mtad.bench.report.fused_enabled", lambda pair: True)
    assert environment(close_pair, [], None, "none", None)["bookkeeping"] == "compiled"  # what the bench records


def test_a_function_that_fails_to_compile_runs_as_written(caplog: pytest.LogCaptureFixture) -> None:
    """More settings than dynamo keeps graphs for, or anything else that stops a compile, costs speed only."""

    def reads_the_host(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x  # a host read: no single graph holds it

    f = fused.Fused(reads_the_host)
    x = torch.ones(3)
    with caplog.at_level("WARNING"):
        assert torch.equal(f(x, fuse=True), x * 2) and f.failed
    assert "runs uncompiled" in caplog.text
    assert torch.equal(f(-x, fuse=True), -x)


@pytest.mark.parametrize("settings", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
@pytest.mark.parametrize("rows", [1, 6])
def test_a_beam_step_compiled_equals_the_step_as_written(settings: Settings, rows: int) -> None:
    warp, x = warp_of(settings), logits_with_ties(rows, seed=rows)
    scores = torch.zeros(1) if rows == 1 else torch.randn(rows, generator=torch.Generator().manual_seed(1))
    same(beam_step(x, scores, warp, 6, fuse=False), beam_step(x, scores, warp, 6, fuse=True))


@pytest.mark.parametrize("settings", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
@pytest.mark.parametrize("g", [4, 1])
def test_mtad_s_rule_compiled_equals_the_rule_as_written(settings: Settings, g: int) -> None:
    """Drafts of the target's likeliest tokens, then one it gives no mass: a hand-made case where the
    passing prefix is known (the first g - 1 pass at τ = 0.1, the last cannot)."""
    warp, x = warp_of(settings), logits_with_ties(g + 1, seed=10 + g)
    draft = x[:g].argmax(-1)
    draft[-1] = x[g - 1].argmin()  # outside every warped distribution: log p = -inf
    lq = torch.full((g,), math.log(0.5))
    u = None if settings.is_greedy else torch.rand(1, generator=torch.Generator().manual_seed(3))
    eager = mtad_rule(x, draft, lq, warp, threshold(0.1), u, fuse=False)
    same(eager, mtad_rule(x, draft, lq, warp, threshold(0.1), u, fuse=True))
    assert int(eager[2]) == g - 1
    assert int(mtad_rule(x, draft, lq, warp, None, u, fuse=True)[2]) == 0  # τ = 1 passes nothing


@pytest.mark.parametrize("settings", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
def test_sd_s_rule_compiled_equals_the_rule_as_written(settings: Settings) -> None:
    g = 4
    warp, x = warp_of(settings), logits_with_ties(g + 1, seed=20)
    log_q = log_probs(x[:g] + torch.randn(g, VOCAB, generator=torch.Generator().manual_seed(4)), warp)
    draft = log_q.argmax(-1)
    gen = torch.Generator().manual_seed(5)
    tests, u = (None, None) if settings.is_greedy else (torch.rand(g, generator=gen), torch.rand(1, generator=gen))
    q = DraftDistributions(log_q, None, None, VOCAB)
    same(sd_rule(x, draft, q, warp, tests, u, fuse=False), sd_rule(x, draft, q, warp, tests, u, fuse=True))


@pytest.mark.parametrize("shape", [(VOCAB,), (3, VOCAB)])
def test_a_draw_compiled_equals_the_draw_as_written(shape: tuple) -> None:
    x = logits_with_ties(math.prod(shape) // VOCAB, seed=30).view(shape)
    u = torch.rand((*shape[:-1], 1), generator=torch.Generator().manual_seed(6))
    (eager, col), (compiled, compiled_col) = (
        sample_rows(x, warp_of(SAMPLING), u, fuse=False),
        sample_rows(x, warp_of(SAMPLING), u, fuse=True),
    )
    if isinstance(eager, tuple):  # on the CPU, the lists its distribution lives on
        eager = DraftDistributions(None, *eager, VOCAB).full().view(shape)
    same((eager, col), (compiled, compiled_col))


def test_new_settings_are_inputs_to_the_same_graphs() -> None:
    """A visitor's new temperature, top-p or τ runs the graph already compiled: only turning the
    temperature or top-p on or off makes a new one."""
    counter = CompileCounterWithBackend("inductor")
    code = mtad_rule.eager
    fresh = types.FunctionType(code.__code__.replace(), code.__globals__, code.__name__, code.__defaults__)
    rule = torch.compile(fresh, fullgraph=True, backend=counter)  # its own graphs, not other tests'
    x = logits_with_ties(3, seed=40)
    draft, lq, u = x[:2].argmax(-1), torch.full((2,), -0.5), torch.rand(1)
    values = [(1.0, 0.9, 0.1), (0.8, 0.9, 0.1), (0.8, 0.8, 0.1), (0.8, 0.8, 0.2), (0.7, 0.85, 0.3), (0.6, 0.7, 0.0)]
    for temperature, top_p, tau in values:
        warp = warp_of(Settings(temperature=temperature, top_p=top_p))
        same(mtad_rule.eager(x, draft, lq, warp, threshold(tau), u), rule(x, draft, lq, warp, threshold(tau), u))
    assert counter.frame_count == 2  # T = 1, then T != 1


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
def test_decoders_with_compiled_bookkeeping_write_the_same_text(
    monkeypatch: pytest.MonkeyPatch, close_pair: ModelPair, method: str, greedy: bool
) -> None:
    s = Settings(method=method, greedy=greedy, gamma=3, beams=4, tau=0.2, seed=7, max_new_tokens=24)
    ids = close_pair.encode("abc abc")
    texts = []
    for compiled in (True, False):
        compile_bookkeeping(monkeypatch, compiled)
        texts.append([t for st in decode(close_pair, ids, s) for t in st.appended_ids])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
def test_one_host_read_per_iteration_around_the_compiled_bookkeeping(
    monkeypatch: pytest.MonkeyPatch, close_pair: ModelPair, method: str, greedy: bool
) -> None:
    """A compiled function cannot read the host (``fullgraph`` refuses a graph that does), and a dispatch
    mode that counts reads cannot run one: so the functions run as written here, counted, with what the
    compiled ones take (the distribution and τ as device tensors) and the warps' general paths, as on a GPU."""
    s = Settings(method=method, greedy=greedy, gamma=3, beams=4, tau=0.2, seed=1, max_new_tokens=40)
    with pytest.MonkeyPatch.context() as patch:  # host_reads undoes the test's own monkeypatch
        patch.setattr("mtad.decoding.state.fused_enabled", lambda pair: True)
        patch.setattr(fused.Fused, "__call__", lambda self, *a, fuse=False, **k: self.eager(*a, **k))
        st = DecodeState.start(close_pair, close_pair.encode("abc abc"), s)
        assert st.fused and (greedy or isinstance(st.warp.top_p, torch.Tensor))
        for _ in range(4):
            with host_reads(monkeypatch) as counts:
                DECODERS[method].step(st)
            assert counts == Counter(tolist=1), counts


def test_the_compiled_engine_s_warm_up_compiles_the_bookkeeping(
    monkeypatch: pytest.MonkeyPatch, close_pair: ModelPair
) -> None:
    """After ``warm_up_pair``, a generation at the default settings compiles nothing more."""
    monkeypatch.setattr("mtad.decoding.precompile.fused_enabled", lambda pair: True)
    compile_bookkeeping(monkeypatch)
    pair = dataclasses.replace(close_pair, engine="compiled")
    warm_up_pair(pair, Settings().gamma + 1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for method in ("ar", "sd", "mtad"):
            assert list(decode(pair, pair.encode("abc abc"), Settings(method=method, max_new_tokens=20)))


def test_sd_s_rule_draws_from_the_lists_what_it_draws_from_whole_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU SD's residual is drawn over the target's top-k list where p lives there, with q read from the
    draft's own lists: the same verdicts and tokens as over the whole rows (a GPU's path), rejections and bonus
    tokens alike."""
    warp, g = warp_of(SAMPLING), 4
    gen = torch.Generator().manual_seed(21)
    listed = rejected = q_listed = 0
    for trial in range(120):
        x = logits_with_ties(g + 1, seed=100 + trial)
        y = x[:g] + torch.randn(g, VOCAB, generator=gen)
        if trial % 3 == 0:  # every draft kept, and q at row g - 1 near p at row g: the bonus token is p's
            y = x[1:] + 0.1 * torch.randn(g, VOCAB, generator=gen)
        lq, drawn = sample_logits(y, warp, torch.rand(g, 1, generator=gen))
        q = (
            DraftDistributions(None, lq[0], lq[1], VOCAB)
            if isinstance(lq, tuple)
            else DraftDistributions(lq, None, None, VOCAB)
        )
        q_listed += q.listed
        draft = drawn if trial % 2 else x[:g].argmax(-1)
        tests, u = torch.rand(g, generator=gen), torch.rand(1, generator=gen)
        if trial % 3 == 0:
            tests, draft = torch.zeros(g), x[:g].argmax(-1)
        fast = sd_rule(x, draft, q, warp, tests, u)
        with monkeypatch.context() as m:
            m.setattr("mtad.sampling._none_on_cpu", lambda t: False)
            whole = sd_rule(x, draft, DraftDistributions(log_probs(y, warp), None, None, VOCAB), warp, tests, u)
        same(whole, fast)
        listed += bool(RowDistributions(x, warp).probs_at(fast[2].view(1))[1] is not None)
        rejected += int(fast[2]) < g
    assert listed > 60 and 20 < rejected < 100 and q_listed > 60


def test_draft_distributions_as_lists_are_the_whole_rows() -> None:
    """The draft's distributions kept as top-k lists give what whole rows give, bit for bit: log q of the drafts, q at
    other tokens (on and off the lists), whole rows, and the rows of a draft mixing listed and whole steps."""
    warp, g = warp_of(SAMPLING), 3
    gen = torch.Generator().manual_seed(8)
    y = logits_with_ties(2 * g, seed=9).view(2, g, VOCAB)
    steps = [sample_logits(y[:, i], warp, torch.rand(2, 1, generator=gen)) for i in range(g)]
    assert all(isinstance(lq, tuple) for lq, _ in steps)
    rows = log_probs(y, warp)
    distributions = DraftDistributions.of_steps(
        [lq for lq, _ in steps], VOCAB, spread=lambda t: t, tokens_of=lambda t: t
    )
    assert distributions.listed and torch.equal(distributions.full(), rows)
    whole = DraftDistributions(rows, None, None, VOCAB)
    drawn = torch.stack([col for _, col in steps], dim=1)
    others = torch.randint(VOCAB, (1, 50), generator=gen)
    for w in range(2):
        assert torch.equal(distributions.seq(w).of(drawn[w]), whole.seq(w).of(drawn[w]))
        assert torch.isfinite(distributions.seq(w).of(drawn[w])).all()
        for i in range(g):
            at = torch.tensor([i])
            tokens = torch.cat([distributions.tokens[w, i][None], others], dim=1)
            assert torch.equal(distributions.seq(w).at(at, tokens), whole.seq(w).at(at, tokens))
            assert torch.equal(distributions.seq(w).row(at), rows[w, i])
    mixed = [steps[0][0], rows[:, 1], steps[2][0]]
    assert torch.equal(DraftDistributions.of_steps(mixed, VOCAB, lambda t: t, lambda t: t).rows, rows)
