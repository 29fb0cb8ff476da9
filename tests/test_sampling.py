"""Warping (the fused top-k/top-p warp must match transformers' own warpers exactly) and sampling."""

import pytest
import torch
from scipy.stats import chisquare

from mtad.sampling import (
    RowDistributions,
    log_probs,
    make_generator,
    probs,
    sample,
    sample_logits,
    sample_logp,
    sample_token,
    top_log_probs,
    warp,
    warper,
)
from mtad.settings import Settings


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 20, 0.9), (0.7, 5, 0.5), (1.3, 50, 0.99), (1.0, 3, 1.0), (2.0, 1, 0.3), (1.0, 0, 0.9), (0.5, 0, 1.0)],
)
def test_warp_equals_transformers(temperature: float, top_k: int, top_p: float) -> None:
    s = Settings(temperature=temperature, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(0)
    for scale in (0.5, 3.0, 10.0):  # flat to very peaked distributions
        logits = torch.randn(64, 300, generator=g) * scale
        ours = warp(logits.clone(), s)
        theirs = warper(s)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (scale, top_k, top_p)
        torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])
        # and log_probs, normalised by the kept mass warp summed, is their log softmax
        torch.testing.assert_close(log_probs(logits, s), torch.log_softmax(theirs, dim=-1))


def test_top_k_keeps_every_token_tied_with_the_kth_logit() -> None:
    """Three tokens share the third-best logit: top-k 3 keeps all five that reach it, as transformers does."""
    logits = torch.tensor([[5.0, 3.0, 4.0, 3.0, 1.0, 3.0]])
    s = Settings(top_k=3, top_p=1.0)
    kept = torch.isfinite(warp(logits.clone(), s))
    assert kept.tolist() == [[True, True, True, True, False, True]]
    assert torch.equal(kept, torch.isfinite(warper(s)(None, logits.clone())))


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, 1), (0.5, 2), (0.6, 3), (0.75, 4), (0.9, 5)])
def test_top_p_cuts_inside_the_ties_of_the_kth_logit(top_p: float, kept: int) -> None:
    """Top-k 2 keeps the 2.0 and all four 1.0s (p = 0.405 and 0.149 each); top-p then keeps the first
    token and as many ties as have less than top_p of mass ranked above them, as transformers does:
    ties ranked after the 2.0 have 0.405, 0.554, 0.702 and 0.851 above them."""
    logits = torch.tensor([[1.0, 2.0, 1.0, -5.0, 1.0, 1.0]])
    s = Settings(top_k=2, top_p=top_p)
    ours, theirs = warp(logits.clone(), s)[0], warper(s)(None, logits.clone())[0]
    assert int(torch.isfinite(ours).sum()) == int(torch.isfinite(theirs).sum()) == kept
    assert ours[1] == 2.0 and torch.equal(
        ours[torch.isfinite(ours)].sort().values, theirs[torch.isfinite(theirs)].sort().values
    )


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 0.9), (20, 1.0), (5, 0.5), (1, 1.0)])
def test_warp_equals_transformers_on_bf16_ties(top_k: int, top_p: float) -> None:
    """Logits rounded to bf16 tie at the k-th value in many rows: the same tokens survive top-k as with
    transformers' warpers, and top-p keeps as many of a tied group as they do (which ones among equal
    logits is the sort's arbitrary order, there and here)."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(256, 2000, generator=g) * 3).to(torch.bfloat16).float()
    top = logits.topk(top_k + 1, dim=-1).values
    assert (top[:, top_k - 1] == top[:, top_k]).sum() >= 5  # the case this test is about
    s = Settings(top_k=top_k, top_p=top_p)
    ours, theirs = warp(logits.clone(), s), warper(s)(None, logits.clone())
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a[torch.isfinite(a)].sort().values, b[torch.isfinite(b)].sort().values)
    if top_p == 1.0:
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 1.0), (20, 0.87), (5, 0.53)])
def test_many_left_out_ties_count_in_the_distribution(top_k: int, top_p: float) -> None:
    """Dozens of tokens tie at the k-th logit, more than top-k's one ``topk`` call looks past its list: the
    distribution's kept mass counts them all, as transformers' warpers do (a coarse grid of logits; top-p off the
    multiples of 1/60 where a cut would fall exactly on a boundary and rounding decides)."""
    logits = torch.randint(0, 6, (8, 300), generator=torch.Generator().manual_seed(3)).float() / 2
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    assert ((logits == kth).sum(dim=-1) > top_k + 20).all()  # the case this test is about
    s = Settings(top_k=top_k, top_p=top_p)
    theirs = torch.log_softmax(warper(s)(None, logits.clone()), dim=-1)
    ours = log_probs(logits, s)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(torch.isfinite(a).sum(), torch.isfinite(b).sum())
        torch.testing.assert_close(a[torch.isfinite(a)].sort().values, b[torch.isfinite(b)].sort().values)


def test_top_p_boundary_with_exact_ties() -> None:
    """Four equal survivors (probability 1/4 each, exact in floating point) and top-p 0.5: the mass
    ranked above the third is exactly 0.5, so it is dropped, as transformers drops it; two stay."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -10.0]])
    s = Settings(top_k=4, top_p=0.5)
    assert int(torch.isfinite(warp(logits.clone(), s)).sum()) == 2
    assert int(torch.isfinite(warper(s)(None, logits.clone())).sum()) == 2


def test_greedy_is_plain_softmax_and_argmax() -> None:
    logits = torch.randn(4, 50)
    s = Settings(greedy=True)
    torch.testing.assert_close(log_probs(logits, s), torch.log_softmax(logits, -1))
    assert torch.equal(sample_logp(log_probs(logits, s), s), logits.argmax(-1))
    # one row of logits, as the decoders pass it: one token
    assert int(sample_logp(log_probs(logits[1], s), s)) == int(logits[1].argmax())


def test_sampling_respects_the_warp_and_the_seed() -> None:
    s = Settings(top_k=3, top_p=1.0)
    logits = torch.randn(1, 40).repeat(500, 1)
    lp = log_probs(logits, s)
    draws = sample_logp(lp, s, generator=make_generator("cpu", 7))
    assert set(draws.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert torch.equal(draws, sample_logp(lp, s, generator=make_generator("cpu", 7)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_draws_the_weights_distribution_and_never_a_zero(dtype: torch.dtype) -> None:
    """Inverse-CDF sampling: frequencies match the (unnormalised) weights, zero weights never drawn."""
    w = torch.tensor([0.0, 2.0, 0.0, 5.0, 3.0, 0.0, 0.0, 1e-3], dtype=dtype)
    draws = sample(w.repeat(40_000, 1), generator=make_generator("cpu", 11))
    assert draws.shape == (40_000,)
    counts = torch.bincount(draws, minlength=w.numel())
    assert counts[w == 0].sum() == 0
    nz = w > 0
    expected = (w[nz].double() / w.double().sum() * draws.numel()).tolist()
    assert chisquare(counts[nz].tolist(), expected).pvalue > 1e-3


def test_sample_keeps_batch_shape_and_seed() -> None:
    w = torch.rand(3, 4, 50)
    a = sample(w, generator=make_generator("cpu", 5))
    assert a.shape == (3, 4)
    assert torch.equal(a, sample(w, generator=make_generator("cpu", 5)))
    assert not torch.equal(a, sample(w, generator=make_generator("cpu", 6)))


def test_probs_equals_exp_of_normalised_log_probs() -> None:
    lp = log_probs(torch.randn(5, 300) * 3, Settings(top_k=20, top_p=0.9))
    assert torch.isinf(lp).sum() > 0
    assert torch.allclose(probs(lp), lp.exp(), atol=1e-7)
    assert (probs(lp)[torch.isinf(lp)] == 0).all()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "n"),
    [(1.0, 20, 0.9, 8), (0.7, 5, 0.5, 5), (1.3, 50, 0.99, 8), (1.0, 3, 1.0, 3), (2.0, 1, 0.3, 1), (1.0, 20, 0.2, 20)],
)
def test_top_log_probs_are_the_warped_distribution_s_first_tokens(
    temperature: float, top_k: int, top_p: float, n: int
) -> None:
    """A beam step's shortcut: each row's first n tokens under the warped distribution, with their log p under it, equal
    log_probs' own (values to rounding, -inf where dropped, the same kept count), on flat and peaked rows and
    on bf16 logits whose k-th value ties with tokens top-k's list left out."""
    s = Settings(temperature=temperature, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(2)
    ties = 0
    for scale in (0.5, 3.0, 10.0):
        for logits in (
            torch.randn(64, 300, generator=g) * scale,
            (torch.randn(64, 300, generator=g) * scale).bfloat16(),
        ):
            full = log_probs(logits, s)
            values, cols = top_log_probs(logits, s, n)
            assert values.shape == cols.shape == (64, n)
            torch.testing.assert_close(values, full.gather(-1, cols), rtol=1e-5, atol=1e-5)
            first = full.topk(n, dim=-1).values  # the distribution's own first n, in order
            torch.testing.assert_close(values, first, rtol=1e-5, atol=1e-5)
            top = logits.float().topk(top_k + 1, dim=-1).values
            ties += int((top[:, top_k - 1] == top[:, top_k]).sum()) if top_k < 300 else 0
    assert ties > 0  # the left-out ties of the k-th logit, which change the kept mass, were met


def test_top_log_probs_count_every_left_out_tie_in_the_kept_mass() -> None:
    """Three tokens share the 2nd-best logit and top-k is 2: the two that top-k's list left out still hold
    mass. Without top-p the best token has p = e^3 / (e^3 + 3e), as log_probs gives it. With top-p 0.75 the
    best (p = 0.711) is below 0.75, so one tie is kept beside it and the kept mass is e^3 + e; with 0.7 the
    best alone."""
    logits = torch.tensor([[1.0, 3.0, 1.0, -5.0, 1.0]])
    values, cols = top_log_probs(logits, Settings(top_k=2, top_p=1.0), 2)
    assert int(cols[0, 0]) == 1 and int(cols[0, 1]) in (0, 2, 4)
    expected = torch.log_softmax(torch.tensor([3.0, 1.0, 1.0, 1.0]), -1)[:2]
    torch.testing.assert_close(values[0], expected)
    values, _ = top_log_probs(logits, Settings(top_k=2, top_p=0.75), 2)
    torch.testing.assert_close(values[0], torch.log_softmax(torch.tensor([3.0, 1.0]), -1))
    assert int(torch.isfinite(log_probs(logits, Settings(top_k=2, top_p=0.75))).sum()) == 2
    values, _ = top_log_probs(logits, Settings(top_k=2, top_p=0.7), 2)
    assert values[0].tolist() == [0.0, float("-inf")]


def test_the_kept_left_out_ties_count_in_the_normaliser() -> None:
    """Four tokens share the 2nd-best logit and top-k is 2, so three are left out of top-k's list; top-p 0.9
    keeps the best (p = 0.649), the listed tie and two of the three left out (each 0.088 with 0.737, then
    0.825, above them): the kept mass is e^3 + 3e, as transformers' warpers and a log softmax give it."""
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, -5.0]])
    s = Settings(top_k=2, top_p=0.9)
    lp = log_probs(logits, s)[0]
    assert int(torch.isfinite(lp).sum()) == 4
    expected = torch.log_softmax(torch.tensor([3.0, 1.0, 1.0, 1.0]), -1)
    torch.testing.assert_close(lp[torch.isfinite(lp)].sort(descending=True).values, expected)
    theirs = torch.log_softmax(warper(s)(None, logits.clone()), -1)[0]  # which ties: their sort's choice
    torch.testing.assert_close(lp.sort().values, theirs.sort().values)
    values, _ = top_log_probs(logits, s, 2)
    torch.testing.assert_close(values[0], expected[:2])


def test_top_log_probs_leave_what_they_cannot_do_to_log_probs() -> None:
    logits = torch.randn(2, 50)
    assert top_log_probs(logits, Settings(greedy=True), 4) is None
    assert top_log_probs(logits, Settings(top_k=0), 4) is None
    assert top_log_probs(logits, Settings(top_k=3), 4) is None


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "greedy"),
    [(1.0, 20, 0.9, False), (0.7, 5, 0.5, False), (1.0, 20, 1.0, False), (1.0, 0, 0.9, False), (1.0, 20, 0.9, True)],
)
def test_row_distributions_read_the_same_distribution_as_log_probs_bit_for_bit(
    temperature: float, top_k: int, top_p: float, greedy: bool
) -> None:
    """A rule's reads of the distribution (one token's log p per row, one whole row) equal log_probs' whole rows
    exactly, for every token of every row: listed ones, dropped ones and the ties of the k-th logit that
    top-k's list left out, whether top-p keeps them or cuts among them (bf16 logits and a coarse grid make
    those ties common)."""
    s = Settings(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
    g = torch.Generator().manual_seed(5)
    cut_ties = kept_ties = 0
    for logits in (
        (torch.randn(6, 300, generator=g) * 3).bfloat16().float(),
        torch.randint(0, 6, (6, 300), generator=g).float() / 2,  # many-way ties at the k-th value
        torch.randn(6, 300, generator=g) * 0.5,
    ):
        full = log_probs(logits, s)
        distributions = RowDistributions(logits, s)
        for i in range(logits.shape[0]):
            assert torch.equal(distributions.row(torch.tensor([i])), full[i])
        for col in range(logits.shape[-1]):  # every token, each row judging its own
            tokens = torch.full((logits.shape[0],), col)
            assert torch.equal(distributions.of(tokens), full[:, col])
        if top_k and not greedy:
            kth = logits.float().div(temperature).topk(top_k, dim=-1).values[:, -1:]
            ties = logits.float().div(temperature) == kth
            cut_ties += int((ties & ~torch.isfinite(full)).sum())
            kept_ties += int((ties & torch.isfinite(full)).sum())
    if top_k and not greedy:
        assert kept_ties > 0
        if top_p < 1.0:
            assert cut_ties > 0  # top-p cut among the k-th logit's ties: the rank by token id was exercised


def test_row_distributions_judge_a_shorter_draft_by_its_own_rows() -> None:
    """g drafted tokens over g + 1 rows: token i under row i, the last row only drawn from."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 2
    s = Settings(top_k=8, top_p=0.8)
    draft = torch.tensor([3, 7, 1, 30])
    full = log_probs(logits, s)
    assert torch.equal(RowDistributions(logits, s).of(draft), full[:4].gather(1, draft[:, None])[:, 0])


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 0.9), (20, 1.0), (5, 0.5)])
def test_the_cpu_shortcut_and_the_general_path_give_the_same_bits(
    top_k: int, top_p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a distribution whose rows keep no left-out tie is written from its top-k list (a host read decides);
    a GPU always takes the general path. Both give the same bits, rows with and without kept ties alike."""
    s = Settings(top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(9)
    cases = [torch.randn(1, 300, generator=g) * 3, (torch.randn(1, 300, generator=g) * 3).bfloat16().float()]
    cases += [torch.randint(0, 6, (4, 300), generator=g).float() / 2]  # rows that keep ties
    shortcut_taken = 0
    for logits in cases:
        tokens = torch.arange(logits.shape[0]) * 7
        fast = log_probs(logits, s), warp(logits, s), RowDistributions(logits, s)
        shortcut_taken += int(not RowDistributions(logits, s).top.kept_ties.any())
        with monkeypatch.context() as m:
            m.setattr("mtad.sampling._none_on_cpu", lambda t: False)
            general = log_probs(logits, s), warp(logits, s), RowDistributions(logits, s)
            general_rows = [general[2].row(torch.tensor([i])) for i in range(logits.shape[0])]
            general_of = general[2].of(tokens)
        assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
        assert torch.equal(fast[2].of(tokens), general_of)
        for i, row in enumerate(general_rows):
            assert torch.equal(fast[2].row(torch.tensor([i])), row)
    assert shortcut_taken >= 1


@pytest.mark.parametrize(("top_k", "top_p", "temperature"), [(20, 0.9, 1.0), (20, 1.0, 0.8), (5, 0.5, 1.0)])
def test_draws_from_the_top_list_are_the_whole_rows_draws(
    top_k: int, top_p: float, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a distribution that lives on its top-k list is drawn from the list, in token order: the same token
    as the draw over the whole row at every uniform (a GPU's path), for rows with bf16 ties and without."""
    s = Settings(top_k=top_k, top_p=top_p, temperature=temperature)
    g = torch.Generator().manual_seed(11)
    listed_rows = 0
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(64, 3000, generator=g) * 3).to(dtype).float()
        u = torch.rand(64, 1, generator=g)
        fast = sample_logits(logits, s, u), sample_token(logits, s, u), RowDistributions(logits, s)
        fast_picks = [fast[2].sample(torch.tensor([i]), s, u[i]) for i in range(64)]
        listed_rows += sum(fast[2].probs_at(torch.tensor([i]))[1] is not None for i in range(64))
        with monkeypatch.context() as m:
            m.setattr("mtad.sampling._none_on_cpu", lambda t: False)
            lp = log_probs(logits, s)
            want = sample_logp(lp, s, u)
            distributions = RowDistributions(logits, s)
            assert all(distributions.probs_at(torch.tensor([i]))[1] is None for i in range(3))
            general_picks = [distributions.sample(torch.tensor([i]), s, u[i]) for i in range(64)]
        assert torch.isfinite(lp.gather(1, want[:, None])).all()
        dist = fast[0][0]  # on the lists where the distribution lives on them
        if isinstance(dist, tuple):
            dist = torch.full_like(lp, float("-inf")).scatter_(-1, dist[1], dist[0])
        assert torch.equal(dist, lp) and torch.equal(fast[0][1], want) and torch.equal(fast[1], want)
        assert torch.equal(torch.stack(fast_picks), torch.stack(general_picks))
        assert torch.equal(torch.stack(fast_picks), want)
    assert listed_rows > 0


def test_listed_draws_draw_the_distribution() -> None:
    """Draws from the top list follow the warped distribution (chi-square over many draws of one row)."""
    s = Settings(top_k=5, top_p=0.8)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0]])
    p = log_probs(logits, s).exp()[0]
    u = torch.rand(20000, 1, generator=torch.Generator().manual_seed(2))
    drawn = sample_token(logits.expand(20000, -1), s, u)
    counts = torch.bincount(drawn, minlength=8).double()
    kept = p > 0
    assert counts[~kept].sum() == 0
    expected = p[kept].double() / p[kept].double().sum() * 20000
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3
