"""The feature-reading draft (mtad.models.feature_draft) and how decoders feed it (mtad.decoding.features).

It must start as exactly the shortlist draft it is made from, load through the Auto classes, read the
target's true features for every committed position and none for drafted ones (so its KV-cached logits
equal a recompute with those inputs), keep every rule exact (greedy SD equals greedy AR; sampled SD
follows the target's distribution), and be refused where a decoder cannot give it features. The trainer's
one-forward levels must equal each draft chain run on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer, save_pair
from test_sd_distribution import ALPHA, exact_first_two, gof_pvalue, sampled_first_two
from transformers import AutoModelForCausalLM

from mtad.decoding import decode, generate
from mtad.decoding.spec import spec_of
from mtad.decoding.state import DecodeState
from mtad.models.errors import PairError
from mtad.models.feature_draft import FeatureDraftForCausalLM
from mtad.models.pair import ModelPair, load
from mtad.models.shortlist_draft import ShortlistForCausalLM
from mtad.settings import Settings
from training.feature_draft import chain_mask, levels

SD = Settings(method="sd", gamma=2, max_new_tokens=3, temperature=1.3, top_k=5, top_p=0.99)


def feature_draft(
    target: torch.nn.Module, k: int, seed: int, scale: float = 1.0, layers: tuple[int, ...] = (0,)
) -> FeatureDraftForCausalLM:
    """A feature draft of the target's ``layers`` and k of its tokens, its feature map seeded random
    (a zero map would make the features change nothing, and the tests below could not fail)."""
    draft = ShortlistForCausalLM.from_target(target, torch.arange(1, k + 1), layers=layers)
    model = FeatureDraftForCausalLM.from_draft(draft)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.feature_in.weight.copy_(torch.randn(model.feature_in.weight.shape, generator=g) * scale)
    return model.eval()


def pair_dirs(
    root: Path, alphabet: str, vocab: int, hidden: int, k: int, seed: int, layers: tuple[int, ...]
) -> tuple[str, str]:
    """A 2-layer target whose output rows are its embedding's (as SmolLM2's), and a feature draft of its
    ``layers``: with both layers, the draft is the target on its shortlist plus the features' term."""
    tok = make_tokenizer(alphabet, vocab)
    target = make_model(len(tok), hidden, 2, seed=seed, init=0.3)
    with torch.no_grad():
        target.lm_head.weight.copy_(target.model.embed_tokens.weight)
    return save_pair(root, tok, feature_draft(target, k, seed + 1, scale=0.1, layers=layers), target)


@pytest.fixture(scope="module")
def feature_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """A 64-token target and a feature draft with 48 of its tokens."""
    return load(*pair_dirs(tmp_path_factory.mktemp("feature"), "abcdefgh ", 64, 64, 48, 2, (0, 1)), device="cpu")


@pytest.fixture(scope="module")
def micro_feature_pair(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    """A 10-token target and a feature draft with 6 of its tokens (the statistical test)."""
    return load(*pair_dirs(tmp_path_factory.mktemp("micro-feature"), "abc", 10, 32, 6, 4, (0,)), device="cpu")


def test_a_zero_feature_map_is_the_shortlist_draft_it_was_made_from() -> None:
    target = make_model(64, 32, 1, seed=3, init=0.3)
    draft = ShortlistForCausalLM.from_target(target, torch.arange(1, 41), layers=(0,)).eval()
    made = FeatureDraftForCausalLM.from_draft(draft).eval()
    ids = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(0))
    feats = torch.randn(2, 9, 32)
    with torch.no_grad():
        assert torch.equal(made(input_ids=ids, features=feats).logits, draft(input_ids=ids).logits)
        made.feature_in.weight.normal_()
        assert not torch.allclose(made(input_ids=ids, features=feats).logits, draft(input_ids=ids).logits)


def test_it_loads_through_the_auto_classes_and_gives_no_mass_off_the_shortlist(feature_pair: ModelPair) -> None:
    draft = feature_pair.draft
    assert isinstance(draft, FeatureDraftForCausalLM)
    loaded = AutoModelForCausalLM.from_pretrained(draft.name_or_path)
    assert isinstance(loaded, FeatureDraftForCausalLM) and loaded.feature_in.weight.abs().sum() > 0
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        logits = loaded(input_ids=ids, features=torch.randn(1, 4, 64)).logits[0]
    off = torch.ones(logits.shape[-1], dtype=torch.bool)
    off[loaded.columns] = False
    assert torch.isinf(logits[:, off]).all() and torch.isfinite(logits[:, ~off]).all()
    with pytest.raises(ValueError, match="not a shortlist draft"):
        FeatureDraftForCausalLM.from_draft(make_model(64, 32, 1, seed=1))


@pytest.mark.parametrize("method", ["sd", "mtad"])
def test_the_draft_reads_the_targets_true_features_and_none_for_drafted_tokens(
    feature_pair: ModelPair, method: str
) -> None:
    """After every iteration: the kept features equal the target's full recompute at every committed
    position, and the draft's next logits (cached) equal one forward over the committed text with those
    features; a drafted token's logits equal a forward that gives it no feature."""
    s = Settings(method=method, gamma=3, beams=3, max_new_tokens=30, seed=1)
    st = DecodeState.start(feature_pair, feature_pair.encode("abc abd ace"), s)
    step = spec_of(method).step
    draft = feature_pair.draft
    for _ in range(6):
        step(st)
        ids = st.ids
        with torch.no_grad():
            true = feature_pair.target.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]
            kept = st.target.length
            torch.testing.assert_close(st.draft.features.read(0, kept), true[:kept], rtol=1e-4, atol=1e-4)
            feats = torch.cat([torch.zeros(1, 64), true[: len(ids) - 1]])[None]
            full = draft(input_ids=torch.tensor([ids]), features=feats, shortlist_only=True).logits[0, -1]
            cached = st.draft.feed(st.pending(st.draft), columns=True)[0, -1]
            torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
            nxt = int(st.draft.columns[cached.argmax()])
            drafted = st.draft.feed(torch.tensor([[nxt]]), columns=True)[0, -1]
            feats = torch.cat([feats, torch.zeros(1, 1, 64)], dim=1)
            full = draft(input_ids=torch.tensor([ids + [nxt]]), features=feats, shortlist_only=True).logits[0, -1]
            torch.testing.assert_close(drafted, full, rtol=1e-4, atol=1e-4)
        st.draft.rollback(kept)


def test_greedy_sd_and_mtad_at_tau_one_equal_greedy_ar(feature_pair: ModelPair) -> None:
    prompt = "abc abd"
    ar = generate(feature_pair, prompt, Settings(method="ar", greedy=True, max_new_tokens=40)).new_ids
    for s in (
        Settings(method="sd", greedy=True, gamma=3, max_new_tokens=40),
        Settings(method="mtad", greedy=True, tau=1.0, gamma=3, beams=4, max_new_tokens=40),
    ):
        run = generate(feature_pair, prompt, s)
        assert run.new_ids == ar, s.method
    sd = generate(feature_pair, prompt, Settings(method="sd", greedy=True, gamma=3, max_new_tokens=40))
    assert sum(step.accepted for step in sd.steps) > 0, "no draft was ever accepted: the test shows nothing"


def test_sampled_sd_with_a_feature_draft_follows_the_targets_distribution(micro_feature_pair: ModelPair) -> None:
    pair = micro_feature_pair
    ids = pair.encode("abcab")
    exact = exact_first_two(pair, ids, SD)
    first = [next(decode(pair, ids, SD.with_(seed=k))) for k in range(100)]
    assert sum(s.accepted < len(s.draft_ids) for s in first) >= 20, "too few rejections to test the residual"
    assert gof_pvalue(sampled_first_two(pair, ids, SD), exact) > ALPHA


def test_a_decoder_that_cannot_feed_features_and_the_compiled_engine_are_refused(
    feature_pair: ModelPair, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="reads the target's features.*Spectr.*sd, mtad"):
        generate(feature_pair, "abc", Settings(method="spectr", max_new_tokens=5))
    draft_dir, target_dir = feature_pair.draft.name_or_path, feature_pair.target.name_or_path
    with pytest.raises(PairError, match="features.*--engine eager"):
        load(draft_dir, target_dir, device="cpu", engine="compiled")


def test_chain_mask_on_a_hand_made_case() -> None:
    """Three positions, depth 2: level 1 is causal; the level-2 node at p sees level 1 up to p - 1 and
    itself."""
    mask = chain_mask(3, 2).int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [1, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_the_trainers_levels_equal_each_chain_run_alone() -> None:
    """Level m at position p is the chain whose last target-read token is p - m + 1: one forward over
    x_0..x_p with the target's features up to there and none after must give the same distribution."""
    torch.manual_seed(0)
    target = make_model(64, 32, 2, seed=5, init=0.3)
    draft = feature_draft(target, 40, seed=6, scale=0.3)
    ids = torch.randint(1, 64, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = target.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
        logits = target(input_ids=ids[None]).logits[0]
    from training.onpolicy import label

    sample = {"ids": ids.int(), "start": 3, "feats": feats} | label(logits[3:11])
    seen = {}
    import training.feature_draft as trainer

    real = trainer.draft_terms
    trainer.draft_terms = lambda lg, *rest: seen.setdefault(len(seen) + 1, lg) is not None and real(lg, *rest)
    try:
        with torch.no_grad():
            levels(draft, [sample], 3)
    finally:
        trainer.draft_terms = real
    with torch.no_grad():
        for m in (1, 2, 3):
            for k, p in enumerate(range(max(3, m - 1), 11)):
                j = p - m + 1
                inputs = torch.zeros(1, p + 1, 32)
                inputs[0, 1 : j + 1] = feats[:j]
                alone = draft(input_ids=ids[None, : p + 1], features=inputs, shortlist_only=True).logits[0, -1]
                assert torch.allclose(seen[m][k], alone, atol=1e-5), (m, p)


def test_the_bench_leaves_out_what_a_feature_pair_cannot_run_and_refuses_it_by_name(
    feature_pair: ModelPair, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import json

    from mtad.bench import cli as bench

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "abc abd"}) + "\n")
    args = ["--draft", feature_pair.draft.name_or_path, "--target", feature_pair.target.name_or_path]
    args += ["--device", "cpu", "--prompts", str(prompts), "--max-new-tokens", "8", "--no-progress"]
    assert bench.main([*args, "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "note: mtad-tree, spectr, specinfer, hf-assisted left out" in err, err
    ran = json.loads((tmp_path / "out" / "bench.json").read_text())["config"]["methods"]
    assert set(ran) == {"ar", "sd", "mtad", "bild", "mtjd"}, ran
    assert bench.main([*args, "--methods", "sd,spectr", "--out", str(tmp_path / "two")]) == 2
    assert "Spectr does not give it" in capsys.readouterr().err
