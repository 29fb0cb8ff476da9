"""The draft's context n-gram bias: hand-made cases of the bias, the token rows following every cache
operation, and the rules staying exact with the bias on (it is the draft's q)."""

from __future__ import annotations

import pytest
import torch
from test_sd_distribution import ALPHA, RUNS, exact_first_two, gof_pvalue, sampled_first_two
from test_shortlist_draft import SD, micro_shortlist_dirs, micro_shortlist_pair  # noqa: F401  (fixtures)

from mtad.decoding import DECODERS, generate
from mtad.decoding.context_bias import ENV, TokenRows, context_bias, weights_of
from mtad.decoding.kv import KVCache
from mtad.decoding.state import DecodeState
from mtad.decoding.static_lm import StaticKV
from mtad.models.pair import ModelPair
from mtad.settings import Settings

ON = "1,2,4"


def bias_of(ids: list[list[int]], weights: tuple[float, ...], width: int = 10, column_of=None) -> torch.Tensor:
    t = torch.tensor(ids)
    return context_bias(t, t.shape[1], torch.tensor(weights), column_of, width)


def test_each_order_adds_its_weight_to_the_tokens_that_followed_the_suffix() -> None:
    # suffix "5 6": "6" followed "5" once (order 1: token 7 after the earlier 6; order 2: 7 after "5 6")
    got = bias_of([[5, 6, 7, 5, 6]], (1.0, 2.0, 4.0))
    want = torch.zeros(1, 10)
    want[0, 7] = 3.0  # orders 1 and 2; "7 5 6" never occurred before, so order 3 adds nothing
    assert torch.equal(got, want)


def test_a_token_seen_after_the_suffix_twice_gets_the_weight_once() -> None:
    got = bias_of([[3, 4, 3, 4, 3]], (1.0,))  # "3" was followed by 4 twice
    assert got[0, 4] == 1.0 and got.sum() == 1.0


def test_order_one_sees_every_earlier_occurrence_and_no_suffix_sees_itself() -> None:
    assert torch.equal(bias_of([[1, 2, 3, 4]], (5.0, 5.0)), torch.zeros(1, 10))  # nothing repeats
    got = bias_of([[2, 8, 2, 9, 2]], (1.0,))
    assert got[0, 8] == 1.0 and got[0, 9] == 1.0 and got.sum() == 2.0


def test_rows_read_their_own_text() -> None:
    got = bias_of([[5, 6, 5], [7, 8, 7]], (1.0,))
    assert got[0, 6] == 1.0 and got[1, 8] == 1.0 and got.sum() == 2.0


def test_a_shortlist_gets_the_bias_in_its_columns_and_none_off_it() -> None:
    column_of = torch.tensor([3, 0, 1, 3, 2, 3, 3, 3, 3, 3])  # tokens 1, 2, 4 are columns 0, 1, 2; 3 = off
    got = bias_of([[1, 2, 1, 4, 1]], (1.0,), width=3, column_of=column_of)
    assert torch.equal(got, torch.tensor([[0.0, 1.0, 1.0]]))
    assert torch.equal(bias_of([[1, 5, 1]], (1.0,), width=3, column_of=column_of), torch.zeros(1, 3))


@pytest.mark.parametrize("weights", [(1.0, 2.0, 4.0), (0.1, 0.7, 0.3, 1.3), (0.0, 0.45)])
def test_the_hosts_bias_is_the_devices_to_the_bit(weights: tuple[float, ...]) -> None:
    """host_bias on one row: the same columns and values as context_bias, whatever the length, repeats and
    shortlist (awkward weights, so any other order of summing them would show)."""
    from mtad.decoding.context_bias import host_bias, summed_weights

    g = torch.Generator().manual_seed(0)
    w = torch.tensor(weights)
    values = summed_weights(w)
    column_of = torch.tensor([5, 0, 1, 5, 2, 3, 5, 4, 5, 5])  # six columns; 5: off the shortlist
    raised = 0
    for trial in range(300):
        length = int(torch.randint(1, 40, (1,), generator=g))
        row = torch.randint(0, 1 + trial % 9, (1, length), generator=g)  # few distinct tokens: many repeats
        for cols, width in ((None, 10), (column_of, 5)):
            want = context_bias(row, length, w, cols, width)[0]
            found = host_bias(row[0].tolist(), length, values, None if cols is None else cols.tolist(), width)
            got = torch.zeros(width)
            got[list(found)] = torch.tensor(list(found.values()))
            assert torch.equal(got, want), (row.tolist(), cols is None)
            raised += bool(want.any())
    assert raised > 100


def test_weights_come_from_the_operator_then_the_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    draft = torch.nn.Module()
    draft.config = type("Config", (), {"mtad_context_bias": [0.0, 2.0, 4.0]})()
    monkeypatch.delenv(ENV, raising=False)
    assert weights_of(draft) == (0.0, 2.0, 4.0)
    assert weights_of(torch.nn.Linear(2, 2)) == ()
    assert weights_of(draft, exact=False) == ()  # the draft's own weights: exact decoders only
    monkeypatch.setenv(ENV, "off")
    assert weights_of(draft) == ()
    monkeypatch.setenv(ENV, "1, 3")
    assert weights_of(draft) == weights_of(draft, exact=False) == (1.0, 3.0)  # the operator's: every decoder
    monkeypatch.setenv(ENV, "0,0")
    assert weights_of(draft) == ()
    monkeypatch.setenv(ENV, "two")
    with pytest.raises(ValueError, match="weights such as"):
        weights_of(draft)
    monkeypatch.setenv(ENV, "1,-1")
    with pytest.raises(ValueError, match="non-negative"):
        weights_of(draft)


class Rows:
    """What a cache's token rows must hold, kept by hand as lists."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = [[]]

    def write(self, tokens: torch.Tensor, at: int) -> None:
        new = tokens.tolist()
        if len(self.rows) != len(new):
            self.rows = [list(self.rows[0]) for _ in new]
        self.rows = [r[:at] + t for r, t in zip(self.rows, new, strict=True)]


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_token_rows_follow_every_cache_operation(kind: str) -> None:
    config = type("C", (), {"num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 2})()
    if kind == "eager":
        from transformers import LlamaConfig

        cache = KVCache(LlamaConfig(num_hidden_layers=1, num_key_value_heads=1, hidden_size=4, num_attention_heads=2))
    else:
        cache = StaticKV(config, torch.float32, torch.device("cpu"), step=4)
    cache.tokens = TokenRows(torch.device("cpu"))
    want = Rows()
    length = 0

    def feed(tokens: list[list[int]]) -> None:
        """What a forward does to the cache: keys and values at the next slots, then the ids."""
        nonlocal length
        t = torch.tensor(tokens)
        rows, n = t.shape
        if kind == "eager":
            kv = torch.randn(rows, 1, n, 2)
            if cache.rows != rows and cache.length:
                cache.fan_out(rows)
            cache.past_key_values.update(kv, kv.clone(), 0)
        else:
            cache.reserve(rows, length + n)
            cache.wrote(length + n)
        cache.tokens.write(t, length)
        want.write(t, length)
        length += n

    def check() -> None:
        held = cache.tokens.ids[:, :length].tolist()
        assert held == [r[:length] for r in want.rows]
        if len(want.rows) == 1:  # the host's copy, kept up or read anew, holds the same
            assert cache.tokens.host_row()[:length] == want.rows[0][:length]

    feed([[1, 2, 3]])
    check()
    cache.fan_out(3)
    want.rows = [list(want.rows[0]) for _ in range(3)]
    feed([[4], [5], [6]])
    check()
    parent = torch.tensor([2, 2, 0])
    cache.reorder(parent)
    want.rows = [list(want.rows[i]) for i in parent.tolist()]
    check()
    feed([[7], [8], [9]])
    check()
    cache.select_rows(torch.tensor([1, 0]))
    want.rows = [want.rows[1], want.rows[0]]
    check()
    cache.keep_row(1)
    want.rows = [want.rows[1]]
    check()
    cache.crop(2)
    length = 2
    feed([[10, 11]])
    check()
    cache.keep_positions([0, 1, 3])
    want.rows = [[r[i] for i in (0, 1, 3)] for r in want.rows]
    length = 3
    check()


DRAFTERS = ["sd", "mtad", "spectr", "specinfer", "bild", "mtad-tree"]


@pytest.mark.parametrize("method", DRAFTERS)
def test_the_draft_reads_its_rows_own_text_through_decoding(
    monkeypatch: pytest.MonkeyPatch,
    micro_shortlist_pair: ModelPair,  # noqa: F811
    method: str,
) -> None:
    """At every draft forward each row's ids are the text its cached keys were computed from (a fresh forward
    over them gives the same keys), end with the tokens just fed and start with the committed text."""
    monkeypatch.setenv(ENV, ON)
    pair = micro_shortlist_pair
    settings = Settings(method=method, max_new_tokens=30, gamma=3, beams=3, tau=0.1, num_drafts=2, seed=3)
    st = DecodeState.start(pair, pair.encode("abcabcab"), settings)
    assert st.context is not None and isinstance(st.draft.cache, KVCache)
    forwards = []
    run_next = st.run_next

    def checked(lm, tokens):  # noqa: ANN001, ANN202
        out = run_next(lm, tokens)
        if lm is st.draft:
            ids = lm.cache.tokens.ids[:, : lm.length]
            assert torch.equal(ids[:, -tokens.shape[1] :], tokens.expand(ids.shape[0], -1))
            committed = min(len(st.ids), lm.length)
            fresh = pair.draft(input_ids=ids, use_cache=True).past_key_values.layers[0].keys
            torch.testing.assert_close(lm.cache.past_key_values.layers[0].keys, fresh, atol=1e-5, rtol=1e-5)
            assert ids[:, :committed].tolist() == [st.ids[:committed]] * ids.shape[0]
            bias = st.context(lm)
            forwards.append(bool(bias.any()))
            base = torch.randn(bias.shape)  # the bias worked out on the host (one row) adds the device's bits
            assert torch.equal(st.context.add(base, lm), base + bias)
        return out

    monkeypatch.setattr(st, "run_next", checked)
    while st.remaining > 0 and (not st.ids or st.ids[-1] not in pair.eos_ids):
        DECODERS[method].step(st)
    assert forwards and any(forwards), "the text repeats, so some draft forward must be biased"


@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_with_the_bias_still_equals_greedy_ar(
    monkeypatch: pytest.MonkeyPatch,
    micro_shortlist_pair: ModelPair,  # noqa: F811
    method: str,
) -> None:
    monkeypatch.setenv(ENV, ON)
    pair = micro_shortlist_pair
    base = Settings(max_new_tokens=24, temperature=0.0, gamma=3, beams=4, tau=1.0, tau2=0.0, num_drafts=2)
    ar = generate(pair, "abcab", base.with_(method="ar"), raw=True)
    assert generate(pair, "abcab", base.with_(method=method), raw=True).new_ids == ar.new_ids


def test_sd_with_the_bias_matches_the_target_distribution(
    monkeypatch: pytest.MonkeyPatch,
    micro_shortlist_pair: ModelPair,  # noqa: F811
) -> None:
    """The bias changes the draft's distribution (checked) and SD still samples the target's."""
    pair = micro_shortlist_pair
    ids = pair.encode("abcab")
    monkeypatch.setenv(ENV, "3,3")
    st = DecodeState.start(pair, ids, SD)
    biased = st.run_draft(torch.tensor([ids]))
    monkeypatch.setenv(ENV, "off")
    plain = DecodeState.start(pair, ids, SD).run_draft(torch.tensor([ids]))
    assert not torch.allclose(biased, plain), "this prompt repeats: the bias must move the draft's logits"
    monkeypatch.setenv(ENV, "3,3")
    counts = sampled_first_two(pair, ids, SD)
    assert sum(counts.values()) == RUNS
    assert gof_pvalue(counts, exact_first_two(pair, ids, SD)) > ALPHA


@pytest.mark.parametrize("method", ["sd", "mtad"])
def test_the_bias_reads_nothing_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
    micro_shortlist_pair: ModelPair,  # noqa: F811
    method: str,
) -> None:
    """The bias is computed on the device from the rows' ids: an iteration still reads the host once."""
    from collections import Counter

    from test_syncs import host_reads

    monkeypatch.setenv(ENV, ON)
    pair = micro_shortlist_pair
    settings = Settings(method=method, max_new_tokens=40, gamma=3, beams=3, tau=0.1, seed=1)
    st = DecodeState.start(pair, pair.encode("abcabcab"), settings)
    assert st.context is not None
    for _ in range(4):
        with host_reads(monkeypatch) as counts:
            DECODERS[method].step(st)
        assert counts == Counter(tolist=1)


def test_the_status_line_says_when_the_draft_copies_from_the_context(
    monkeypatch: pytest.MonkeyPatch,
    micro_shortlist_pair: ModelPair,  # noqa: F811
) -> None:
    from mtad.ui.pickers import pair_facts

    monkeypatch.setenv(ENV, "0.5,2")
    assert "every decoder's draft copies from the context (n-gram weights 0.5, 2)" in pair_facts(micro_shortlist_pair)
    monkeypatch.setenv(ENV, "off")
    assert "copies" not in pair_facts(micro_shortlist_pair)
    monkeypatch.delenv(ENV)
    monkeypatch.setattr(micro_shortlist_pair.draft.config, "mtad_context_bias", [1.0, 3.0], raising=False)
    assert "the exact decoders' draft copies from the context (n-gram weights 1, 3)" in pair_facts(micro_shortlist_pair)


@pytest.mark.parametrize("method", DRAFTERS)
def test_the_drafts_own_weights_serve_the_exact_decoders_only(
    monkeypatch: pytest.MonkeyPatch,
    micro_shortlist_pair: ModelPair,  # noqa: F811
    method: str,
) -> None:
    """MTAD's and BiLD's texts follow q: the draft's own weights leave them as they were; an operator's
    weights reach every drafting decoder."""
    from mtad.decoding.spec import spec_of

    pair = micro_shortlist_pair
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(pair.draft.config, "mtad_context_bias", [1.0, 3.0], raising=False)
    settings = Settings(method=method, gamma=3, beams=3, num_drafts=2)
    st = DecodeState.start(pair, pair.encode("abcab"), settings)
    assert (st.context is not None) == spec_of(method).exact
    if st.context is not None:
        assert st.context.weights == (1.0, 3.0)
    monkeypatch.setenv(ENV, "2")
    assert DecodeState.start(pair, pair.encode("abcab"), settings).context.weights == (2.0,)
