"""The verification panel cell by cell: what a learner reads there is the rule's own arithmetic.

The panel re-judges a recorded iteration at any τ without the models, so every figure in it must be
the rule's: each prefix's log q, log p, their difference, min(1, p/q) and verdict, SD's per-token
p, q, ratio, uniform and verdict, the sentence that explains the accepted length, the beams and
candidates, and the bar chart's heights, colours, threshold line and shaded accepted prefix.
"""

from __future__ import annotations

import math
from html.parser import HTMLParser

import pytest
from test_ui_render import FakeTokenizer, lane_of, mtad_step, sd_step

from mtad.events import Step
from mtad.ui import verify
from mtad.ui.verify import FAIL, PASS

LOG_TENTH = "-2.303"  # log 0.1, as the panel prints it


class Tables(HTMLParser):
    """Every <table> in a fragment: rows of (row class, [(cell class, cell text, [span classes])])."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tables: list[list[tuple[str, list[tuple[str, str, list[str]]]]]] = []
        self._cell: list | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        cls = dict(attrs).get("class") or ""
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append((cls, []))
        elif tag in ("td", "th"):
            self._cell = [cls, "", []]
        elif tag == "span" and self._cell is not None:
            self._cell[2].append(cls)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1][1].append(tuple(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell[1] += data

    @staticmethod
    def text_of(fragment: str) -> str:
        """The text a reader sees in an HTML fragment."""
        out: list[str] = []
        parser = HTMLParser()
        parser.handle_data = out.append
        parser.feed(fragment)
        return "".join(out)


def texts(row: tuple) -> list[str]:
    return [cell[1] for cell in row[1]]


def paragraphs(html: str) -> list[str]:
    """The verdict's sentences as plain text, one per <p>."""

    class P(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.out: list[str] = []
            self.inside = False

        def handle_starttag(self, tag: str, attrs: list) -> None:
            if tag == "p":
                self.out.append("")
                self.inside = True

        def handle_endtag(self, tag: str) -> None:
            if tag == "p":
                self.inside = False

        def handle_data(self, data: str) -> None:
            if self.inside:
                self.out[-1] += data

    parser = P()
    parser.feed(html)
    return parser.out


def verdict(html: str) -> list[str]:
    """The sentences of the panel's verdict, below its tables."""
    return paragraphs(html.split('<div class="v-verdict">')[1])


# --- MTAD's prefix table ---------------------------------------------------------------------


def test_mtad_table_prints_each_prefix_s_log_probs_ratio_and_verdict():
    # diffs log p - log q: -0.1, -0.1, -2.8, -1.2; at τ 0.1 (log -2.303) prefixes 1, 2, 4 pass: η = 4
    lane = lane_of("mtad", [mtad_step(0)])
    table = Tables(verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())).tables[-1]
    assert texts(table[0]) == ["prefix j", "x_j", "log q_j", "log p_j", "log p_j − log q_j", "min(1, p_j/q_j)", "> τ ?"]
    rows = table[1:]
    assert [texts(r) for r in rows] == [
        ["1", "a", "-0.400", "-0.500", "-0.100", "0.905", "passes"],
        ["2", "<", "-0.900", "-1.000", "-0.100", "0.905", "passes"],
        ["3", ">", "-1.200", "-4.000", "-2.800", "0.061", "fails, kept: inside the passing prefix 4"],
        ["4", "b", "-3.000", "-4.200", "-1.200", "0.301", "passes"],
    ]
    assert [r[0] for r in rows] == ["row-acc"] * 4
    assert [r[1][-1][0] for r in rows] == ["v-pass", "v-pass", "v-fail v-kept", "v-pass"]
    assert [r[1][1][2] for r in rows] == [["vtok"]] * 4


def test_mtad_table_at_a_stricter_tau_marks_the_failing_tail_and_no_kept_note():
    # at τ 0.5 (log -0.693) prefixes 1 and 2 pass, 3 and 4 fail: η = 2, nothing failing is kept
    lane = lane_of("mtad", [mtad_step(0)])
    html = verify.verify_html(lane, 0, 0.5, 0.1, FakeTokenizer())
    rows = Tables(html).tables[-1][1:]
    assert [texts(r)[-1] for r in rows] == ["passes", "passes", "fails", "fails"]
    assert [r[0] for r in rows] == ["row-acc", "row-acc", "", ""]
    assert [r[1][-1][0] for r in rows] == ["v-pass", "v-pass", "v-fail", "v-fail"]
    assert "v-kept-note" not in html


def test_mtad_kept_note_speaks_of_one_or_several_failing_prefixes():
    # diffs -3, -3, -1 at τ 0.1: prefixes 1 and 2 fail, 3 passes, so both are kept inside it
    lane = lane_of("mtad", [mtad_step(0, draft=(1, 2, 1), log_p=(-4.0, -5.0, -3.0), log_q=(-1.0, -2.0, -2.0))])
    html = verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())
    assert '<p class="v-kept-note">Prefixes 1, 2 fail on their own, yet their tokens are kept: they lie inside ' in html
    assert (
        "prefix 3, which passes. MTAD keeps the <b>longest</b> passing prefix, not the prefix before the first "
        "failure — a joint ratio can dip and recover, because a later token the target likes more than the draft "
        "did raises p/q for the whole prefix.</p>"
    ) in html
    one = lane_of("mtad", [mtad_step(0, draft=(1, 2), log_p=(-4.0, -1.5), log_q=(-1.0, -0.5))])
    html = verify.verify_html(one, 0, 0.1, 0.1, FakeTokenizer())
    assert '<p class="v-kept-note">Prefix 1 fails on its own, yet its tokens are kept: they lie inside prefix 2' in html


def test_mtad_table_shows_zero_probability_prefixes_as_minus_infinity_and_ratio_zero():
    lane = lane_of("mtad", [mtad_step(0, log_p=(-0.5, -math.inf, -math.inf, -math.inf))])
    rows = Tables(verify.verify_html(lane, 0, 0.0, 0.1, FakeTokenizer())).tables[-1][1:]
    assert texts(rows[0])[2:] == ["-0.400", "-0.500", "-0.100", "0.905", "passes"]
    assert texts(rows[1])[2:] == ["-0.900", "−∞", "−∞", "0.000", "fails"]


# --- SD's token table ------------------------------------------------------------------------


def test_sd_table_prints_each_token_s_p_q_ratio_uniform_and_verdict():
    # per-token log p: -0.1, -2.9, -0.5; log q: -0.2, -0.3, -0.5; u: 0.5, 0.9, 0.1; accepted 1
    lane = lane_of("sd", [sd_step(0)])
    table = Tables(verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())).tables[-1]
    assert texts(table[0]) == ["i", "x_i", "p_i(x_i)", "q_i(x_i)", "p/q", "uniform u_i", "verdict"]
    rows = table[1:]
    assert [texts(r) for r in rows] == [
        ["1", "<", "0.905", "0.819", "1.105", "0.500", "accepted"],
        ["2", "↵", "0.055", "0.741", "0.074", "0.900", "rejected"],
        ["3", "a", "0.607", "0.607", "1.000", "0.100", "not judged (after a rejection)"],
    ]
    assert [r[0] for r in rows] == ["row-acc", "", ""]
    assert [r[1][-1][0] for r in rows] == ["v-pass", "v-fail", "v-skip"]


def test_greedy_sd_table_has_no_uniforms_and_a_zero_probability_token_shows_zero():
    step = sd_step(0)
    step.uniforms, step.accepted = None, 3
    step.log_p = [-0.1, -math.inf, -math.inf]
    rows = Tables(verify.verify_html(lane_of("sd", [step]), 0, 0.1, 0.1, FakeTokenizer())).tables[-1][1:]
    assert [texts(r)[5] for r in rows] == ["— (greedy)"] * 3
    assert texts(rows[1])[2:5] == ["0", "0.741", "0.000"]
    assert [texts(r)[-1] for r in rows] == ["accepted"] * 3 and [r[0] for r in rows] == ["row-acc"] * 3


# --- the verdict in words --------------------------------------------------------------------


def test_mtad_verdict_names_the_passing_prefixes_and_what_the_run_kept():
    lane = lane_of("mtad", [mtad_step(0)])
    html = verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())
    assert verdict(html) == [
        f"At τ = 0.100 (log τ = {LOG_TENTH}) the passing prefixes are: 1, 2, 4. MTAD keeps the longest passing "
        "prefix, so it accepts 4 of 4 draft tokens, then takes one token from the target at position 5.",
        f"The run used τ = 0.100: it accepted 4, then the target wrote {target_text(lane)}.",
    ]
    assert html.count("v-target-token") == 1
    strict = verdict(verify.verify_html(lane, 0, 0.5, 0.1))
    assert strict[0].startswith("At τ = 0.500 (log τ = -0.693) the passing prefixes are: 1, 2.")
    assert "accepts 2 of 4 draft tokens, then takes one token from the target at position 3." in strict[0]
    assert strict[2].startswith("At this τ the prefix kept would differ")
    never = verdict(verify.verify_html(lane, 0, 1.0, 0.1))
    assert never[0].startswith("At τ = 1.000 (log τ = 0.000) the passing prefixes are: none.")
    assert never[-1] == "τ = 1 rejects every draft: min(1, p/q) never exceeds 1, so MTAD becomes AR."
    every = verdict(verify.verify_html(lane, 0, 0.0, 0.1))
    assert every[0].startswith("At τ = 0.000 (log τ = −∞) the passing prefixes are: 1, 2, 3, 4.")
    assert every[-1] == "τ = 0 accepts every prefix the target gives a non-zero probability."
    assert len(every) == 3 and not [line for line in every if "would differ" in line]  # η = 4, as in the run


def test_sd_verdict_explains_the_uniform_rule_and_the_resample():
    html = verify.verify_html(lane_of("sd", [sd_step(0)]), 0, 0.1, 0.1, FakeTokenizer())
    # SD's joint diffs 0.1, -2.5, -2.5: at τ 0.1 only prefix 1 passes
    assert verdict(html) == [
        "SD accepts x_i when u_i < p_i/q_i and stops at the first rejection: it accepted 1 of 3, then added a "
        "token resampled from norm(max(0, p − q)) b. This is what keeps SD's output distributed exactly like "
        "the target's; τ plays no part.",
        f"For comparison, MTAD's joint rule at τ = 0.100 (log τ = {LOG_TENTH}) would accept 1 of this draft.",
    ]
    assert '<b class="v-eta">1</b> of 3' in html


def test_greedy_sd_verdict_speaks_of_the_argmax_and_the_bonus_token():
    step = sd_step(0)
    step.uniforms, step.accepted = None, 3
    html = verify.verify_html(lane_of("sd", [step]), 0, 0.1, 0.1, FakeTokenizer())
    assert verdict(html)[0].startswith(
        "greedy SD accepts while each draft token is also the target's argmax: it accepted 3 of 3, then added "
        "a bonus token from the target b."
    )


@pytest.mark.parametrize("method", ["bild", "spectr", "specinfer"])
def test_other_decoders_verdict_states_their_rule_and_mtad_s_for_comparison(method: str):
    step = sd_step(0)
    step.method = method
    html = verify.verify_html(lane_of(method, [step]), 0, 0.1, 0.1, FakeTokenizer())
    followed = "" if method == "bild" else " of the followed candidate"  # BiLD drafts one sequence
    assert verdict(html) == [
        f"{verify.RULES[method]}. It kept 1 of 3 draft tokens{followed}, then added the target's token b.",
        f"For comparison, MTAD's joint rule at τ = 0.100 (log τ = {LOG_TENTH}) would accept 1 of this draft.",
    ]
    assert Tables(html).tables[-1][0][1][-1][1] == "verdict"  # the per-token table, as for SD


def target_text(lane) -> str:
    """The target's own token of the lane's first iteration, as the panel's verdict names it."""
    return Tables.text_of(verify.target_token_html(lane, lane.steps[0], FakeTokenizer()))


@pytest.mark.parametrize("method", ["sd", "mtad", "spectr", "specinfer", "bild"])
def test_the_verdict_names_the_token_the_target_wrote_after_the_accepted_drafts(method: str):
    """For each decoder the panel names the target's own token (bonus, recovered or fallback): the appended
    token the target wrote, decoded after the accepted drafts, not a draft token and not the next iteration's."""
    step = mtad_step(0) if method == "mtad" else walk_step(method) if method in ("spectr", "specinfer") else sd_step(0)
    step.method = method
    step.appended_ids = [*step.appended_ids[: step.accepted], 1]  # the target wrote id 1 ("a") after the accepted ones
    step.from_target = [False] * step.accepted + [True]
    lane = lane_of(method, [step, sd_step(1)])
    html = verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())
    named = [line for line in verdict(html) if "target" in line and f" {FakeTokenizer().decode([1])}." in line]
    assert len(named) == 1 and html.count('class="vtok v-target-token"') == 1, verdict(html)
    written = verify.target_token_html(lane, step, FakeTokenizer())
    assert f">{FakeTokenizer().decode([1])}<" in written
    stopped = sd_step(0)
    stopped.from_target = [False] * len(stopped.appended_ids)  # a stopped text: the target wrote nothing
    assert verify.target_token_html(lane_of("sd", [stopped]), stopped, FakeTokenizer()) == ""


# --- head, beams, candidates -----------------------------------------------------------------


def test_panel_head_names_the_lane_the_iteration_and_the_draft_and_clamps_the_index():
    lane = lane_of("mtad", [mtad_step(0), mtad_step(1), mtad_step(2)])
    head = '<div class="v-head">MTAD · iteration {} of 3 · drafted 4 token(s) with W = 2 beams</div>'
    assert head.format(2) in verify.verify_html(lane, 1, 0.1, 0.1)
    assert head.format(3) in verify.verify_html(lane, 99, 0.1, 0.1)
    assert head.format(1) in verify.verify_html(lane, -4, 0.1, 0.1)
    sd = verify.verify_html(lane_of("sd", [sd_step(0)]), 0, 0.1, 0.1)
    assert '<div class="v-head">Speculative decoding · iteration 1 of 1 · drafted 3 token(s)</div>' in sd


def test_an_iteration_without_a_draft_says_the_target_wrote_alone():
    last = Step(index=0, method="mtad", appended_ids=[2], from_target=[True], target_logprobs=[-1.0])
    html = verify.verify_html(lane_of("mtad", [last]), 0, 0.1, 0.1)
    assert "drafted 0 token(s)</div><p>No draft this iteration: only one token of the budget was left" in html
    assert "<table" not in html


def test_beams_are_listed_best_first_with_the_chosen_one_starred():
    step = mtad_step(0)
    step.beams, step.beam_scores, step.best_beam = [[2, 2, 2, 2], [1, 3, 4, 2], [4, 4, 1, 1]], [-5.0, -3.0, -4.0], 1
    html = verify.verify_html(lane_of("mtad", [step]), 0, 0.1, 0.1, FakeTokenizer())
    assert "The draft model's 3 beams (best by joint log q first; ★ = the one sent to the target)" in html
    beams = Tables(html).tables[0]
    assert [texts(r) for r in beams] == [
        ["beam", "tokens", "joint log q"],
        ["★ beam 2", "a<>b", "-3.000"],
        ["beam 3", ">>aa", "-4.000"],
        ["beam 1", "bbbb", "-5.000"],
    ]
    assert [r[0] for r in beams[1:]] == ["beam-chosen", "", ""]
    assert beams[1][1][1][2] == ["vtok"] * 4


def test_candidates_mark_each_kept_prefix_and_the_followed_one():
    step = sd_step(0)
    step.method = "spectr"
    step.candidates, step.candidate_kept, step.chosen = [[2, 2, 1], [3, 5, 1]], [0, 1], 1
    html = verify.verify_html(lane_of("spectr", [step]), 0, 0.1, 0.1, FakeTokenizer())
    assert "All 2 candidates, verified in one target forward (★ = the one whose prefix was kept)" in html
    cands = Tables(html).tables[0]
    assert [texts(r) for r in cands] == [
        ["candidate", "tokens", "kept"],
        ["1", "bba", "0 of 3"],
        ["★ 2", "<↵a", "1 of 3"],
    ]
    assert [r[0] for r in cands[1:]] == ["", "beam-chosen"]
    assert [cands[i][1][1][2] for i in (1, 2)] == [["vtok"] * 3, ["vtok vtok-kept", "vtok", "vtok"]]


def test_mtad_tree_candidates_replace_the_beam_list():
    step = mtad_step(0)
    step.method = "mtad-tree"
    step.candidates, step.candidate_kept, step.chosen = [[1, 3, 4, 2], [2, 2, 2, 2]], [4, 0], 0
    html = verify.verify_html(lane_of("mtad-tree", [step]), 0, 0.1, 0.1, FakeTokenizer())
    assert "All 2 candidates" in html and "beams (best by joint log q" not in html
    assert texts(Tables(html).tables[-1][0])[0] == "prefix j"  # MTAD's prefix table follows


class ParityTokenizer:
    """Decodes a token in capitals at odd positions of the decoded ids, so a piece depends on its context."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(
            FakeTokenizer().decode([t]).upper() if k % 2 else FakeTokenizer().decode([t]) for k, t in enumerate(ids)
        )


def test_draft_pieces_are_decoded_after_the_context_the_models_saw():
    # prompt (1, 2) + 5 appended tokens: iteration 2's drafts start at position 7 of the decoded ids, odd
    steps = [mtad_step(0), mtad_step(1)]
    assert len(steps[0].appended_ids) == 5
    lane = lane_of("mtad", steps)
    assert verify.context_before(lane, 1) == [1, 2, 1, 3, 4, 2, 6]
    assert verify.draft_pieces(lane, 1, ParityTokenizer(), [1, 2]) == ["A", "b"]
    assert verify.draft_pieces(lane, 0, ParityTokenizer(), [1, 2]) == ["a", "B"]
    assert verify.draft_pieces(lane, 0, None, [1, 2]) == ["#1", "#2"]


# --- the bar chart ---------------------------------------------------------------------------


def test_mtad_figure_bars_colours_threshold_and_accepted_band():
    lane = lane_of("mtad", [mtad_step(0)])
    fig = verify.verify_figure(lane, 0, 0.5)  # diffs -0.1, -0.1, -2.8, -1.2; η = 2
    (bars,) = fig.data
    assert list(bars.y) == pytest.approx([-0.1, -0.1, -2.8, -1.2]) and list(bars.x) == [1, 2, 3, 4]
    assert list(bars.marker.color) == [PASS, PASS, FAIL, FAIL]
    assert list(bars.marker.pattern.shape) == ["", "", "", ""]
    assert list(bars.text) == ["-0.100", "-0.100", "-2.800", "-1.200"]
    line = [s for s in fig.layout.shapes if s.type == "line"]
    band = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(line) == 1 and line[0].y0 == pytest.approx(math.log(0.5)) and line[0].line.dash == "dash"
    assert len(band) == 1 and (band[0].x0, band[0].x1) == (0.5, 2.5)
    assert fig.layout.annotations[0].text == "log τ = -0.69"
    assert fig.layout.title.text == "Prefix j passes when its bar is above log τ: accepted η = 2"
    assert fig.layout.yaxis.title.text == "log p_j − log q_j" and fig.layout.xaxis.title.text == "prefix length j"
    assert fig.layout.showlegend is False and fig.layout.xaxis.dtick == 1 and fig.layout.height == 300


def test_mtad_figure_draws_zero_probability_prefixes_hatched_at_a_floor_below_everything():
    lane = lane_of("mtad", [mtad_step(0, log_p=(-0.5, -math.inf, -math.inf, -math.inf))])
    fig = verify.verify_figure(lane, 0, 0.1)  # the floor: 2 below min(-0.1, log 0.1)
    floor = math.log(0.1) - 2
    assert list(fig.data[0].y) == pytest.approx([-0.1, floor, floor, floor])
    assert list(fig.data[0].marker.pattern.shape) == ["", "/", "/", "/"]
    assert list(fig.data[0].marker.color) == [PASS, FAIL, FAIL, FAIL]
    assert list(fig.data[0].text) == ["-0.100", "−∞", "−∞", "−∞"]
    # at τ 0 there is no threshold line, and the floor is 2 below the lowest finite bar
    zero = verify.verify_figure(lane, 0, 0.0)
    assert list(zero.data[0].y) == pytest.approx([-0.1, -2.1, -2.1, -2.1])
    assert [s.type for s in zero.layout.shapes] == ["rect"]
    # at τ 1 nothing passes: no accepted band, every bar red
    never = verify.verify_figure(lane, 0, 1.0)
    assert not [s for s in never.layout.shapes if s.type == "rect"]
    assert list(never.data[0].marker.color) == [FAIL] * 4


def test_sd_figure_bars_against_log_uniforms():
    step = sd_step(0)
    step.uniforms = [0.5, 0.0, 0.1]  # a draw of 0 has log −∞: drawn at the floor
    fig = verify.verify_figure(lane_of("sd", [step]), 0, 0.1)
    bars, draws = fig.data
    assert list(bars.y) == pytest.approx([0.1, -2.6, 0.0]) and list(bars.x) == list(draws.x) == [1, 2, 3]
    assert list(bars.marker.color) == [PASS, FAIL, FAIL]
    assert list(bars.text) == ["0.100", "-2.600", "0.000"]
    floor = -2.6 - 2  # 2 below the lowest bar or draw
    assert list(draws.y) == pytest.approx([math.log(0.5), floor, math.log(0.1)]) and draws.mode == "markers"
    assert draws.name == "log u_i (accept when the bar is above it)"
    band = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(band) == 1 and (band[0].x0, band[0].x1) == (0.5, 1.5)
    assert not [s for s in fig.layout.shapes if s.type == "line"]  # τ plays no part in SD
    assert fig.layout.title.text == "SD: per-token log p/q against the uniform draw: accepted 1"
    assert fig.layout.showlegend is True


def test_greedy_sd_figure_has_bars_only_and_zero_accepted_has_no_band():
    step = sd_step(0)
    step.uniforms, step.accepted = None, 0
    fig = verify.verify_figure(lane_of("sd", [step]), 0, 0.1)
    assert len(fig.data) == 1 and list(fig.data[0].marker.color) == [FAIL] * 3
    assert not fig.layout.shapes
    bild = sd_step(0)
    bild.method = "bild"
    assert verify.verify_figure(lane_of("bild", [bild]), 0, 0.1).layout.showlegend is False


def test_figure_without_a_run_or_for_ar_asks_for_an_iteration():
    for lane in (None, lane_of("ar", [Step(index=0, method="ar", appended_ids=[1], from_target=[True])])):
        fig = verify.verify_figure(lane, 0, 0.1)
        assert not fig.data and fig.layout.title.text == "Pick an iteration" and fig.layout.height == 280


# --- what else a reader sees -----------------------------------------------------------------


class Loose(HTMLParser):
    """Text that lies directly in a table, a row or a panel-level <div>, outside any cell or sentence."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.loose: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        cls = dict(attrs).get("class") or ""
        self.stack.append(tag if tag != "div" or cls.split()[0] in ("mtad-verify", "v-verdict") else "text")

    def handle_endtag(self, tag: str) -> None:
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        if data.strip() and (not self.stack or self.stack[-1] in ("table", "tr", "div")):
            self.loose.append(data)


@pytest.mark.parametrize("method", ["mtad", "mtad-tree", "sd", "spectr"])
def test_the_panel_has_no_text_outside_its_cells_and_sentences(method: str):
    step = mtad_step(0) if method.startswith("mtad") else sd_step(0)
    step.method = method
    if method in ("mtad-tree", "spectr"):
        step.candidates, step.candidate_kept, step.chosen = [step.draft_ids, [2] * len(step.draft_ids)], [1, 0], 0
    lane = lane_of(method, [step])
    for tau in (0.1, 0.9):
        html = verify.verify_html(lane, 0, tau, 0.1, FakeTokenizer())
        assert html.startswith('<div class="mtad-verify"><div class="v-head">') and html.endswith("</div></div>")
        assert Loose(html).loose == []
    for empty in (None, lane_of("ar", [Step(index=0, method="ar", appended_ids=[1], from_target=[True])])):
        html = verify.verify_html(empty, 0, 0.1, 0.1)
        assert html.startswith('<div class="mtad-verify v-empty">') and html.endswith("</div>")
        assert paragraphs(f"<p>{html}</p>")[0] in (
            "Run a prompt, then pick an iteration of either lane to inspect.",
            "The autoregressive lane drafts nothing: there is nothing to verify.",
        )
    last = Step(index=0, method="mtad", appended_ids=[2], from_target=[True], target_logprobs=[-1.0])
    assert verify.verify_html(lane_of("mtad", [last]), 0, 0.1, 0.1).endswith("generated it alone.</p></div>")
    beamless = mtad_step(0)
    beamless.beams = None
    assert Loose(verify.verify_html(lane_of("mtad", [beamless]), 0, 0.1, 0.1)).loose == []


def test_a_ratio_above_one_is_capped_at_one():
    lane = lane_of("mtad", [mtad_step(0, draft=(1,), log_p=(-0.5,), log_q=(-1.5,))])
    rows = Tables(verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())).tables[-1][1:]
    assert texts(rows[0])[4:] == ["1.000", "1.000", "passes"]


def test_beams_without_scores_keep_drafting_order_and_show_no_score():
    step = mtad_step(0)
    step.beams, step.beam_scores, step.best_beam = [[2, 2, 2, 2], [1, 3, 4, 2]], None, 1
    beams = Tables(verify.verify_html(lane_of("mtad", [step]), 0, 0.1, 0.1, FakeTokenizer())).tables[0]
    assert [texts(r) for r in beams[1:]] == [["beam 1", "bbbb", "—"], ["★ beam 2", "a<>b", "—"]]


def test_candidates_without_kept_counts_show_none_kept():
    step = sd_step(0)
    step.method = "spectr"
    step.candidates, step.candidate_kept, step.chosen = [[3, 5, 1]], None, 0
    cands = Tables(verify.verify_html(lane_of("spectr", [step]), 0, 0.1, 0.1, FakeTokenizer())).tables[0]
    assert texts(cands[1])[2] == "0 of 3" and "vtok-kept" not in str(cands)


def test_mtad_tree_is_judged_and_drawn_by_mtad_s_rule():
    step = mtad_step(0)
    step.method = "mtad-tree"
    step.candidates, step.candidate_kept, step.chosen = [[1, 3, 4, 2]], [4], 0
    lane = lane_of("mtad-tree", [step])
    lines = verdict(verify.verify_html(lane, 0, 0.5, 0.1))
    assert lines[0].startswith("At τ = 0.500 (log τ = -0.693) the passing prefixes are: 1, 2.")
    assert lines[2] == (
        "At this τ the prefix kept would differ; the tokens after it would differ too, because the target's "
        "token would come from another position (nothing is re-run here)."
    )
    fig = verify.verify_figure(lane, 0, 0.5)
    assert fig.layout.title.text.endswith("accepted η = 2")
    assert [s.type for s in fig.layout.shapes] == ["rect", "line"]


def test_every_piece_of_a_later_iteration_is_decoded_after_its_own_context():
    # iteration 2 (index 1) sees 7 ids before its drafts, so with ParityTokenizer its first draft is in capitals
    first, second = mtad_step(0), mtad_step(1)
    second.candidates, second.candidate_kept, second.chosen = [[1, 2], [2, 1]], [1, 0], 0
    lane = lane_of("mtad-tree", [first, second])
    tables = Tables(verify.verify_html(lane, 1, 0.1, 0.1, ParityTokenizer())).tables
    assert [texts(r)[1] for r in tables[0][1:]] == ["Ab", "Ba"]  # the candidates
    assert [texts(r)[1] for r in tables[-1][1:]] == ["A", "<", ">", "b"]  # the prefix table
    second.candidates = None
    tables = Tables(verify.verify_html(lane_of("mtad", [first, second]), 1, 0.1, 0.1, ParityTokenizer())).tables
    assert [texts(r)[1] for r in tables[0][1:]] == ["A<>b", "BbBb"]  # the beams


def test_figure_picks_the_clamped_iteration():
    lane = lane_of("mtad", [mtad_step(0), mtad_step(1, draft=(1, 2), log_p=(-4.0, -1.5), log_q=(-1.0, -0.5))])
    assert len(verify.verify_figure(lane, 99, 0.1).data[0].y) == 2
    assert len(verify.verify_figure(lane, 1, 0.1).data[0].y) == 2
    assert len(verify.verify_figure(lane, -3, 0.1).data[0].y) == 4


def test_figure_floors_when_nothing_is_finite():
    lane = lane_of("mtad", [mtad_step(0, log_p=(-math.inf,) * 4)])
    assert list(verify.verify_figure(lane, 0, 0.0).data[0].y) == [-2.0] * 4  # no finite bar, no line: 0 - 2


def test_sd_figure_hatches_a_zero_probability_token_at_a_floor_below_zero():
    # greedy (no draws): bars 0.1 and 0.3 are finite, the third is −∞: the floor is 2 below min(0.1, 0.3, 0)
    step = sd_step(0)
    step.uniforms, step.accepted = None, 2
    step.log_p, step.log_q = [-0.1, -0.2, -math.inf], [-0.2, -0.6, -1.0]
    bars = verify.verify_figure(lane_of("sd", [step]), 0, 0.1).data[0]
    assert list(bars.y) == pytest.approx([0.1, 0.3, -2.0])
    assert list(bars.marker.pattern.shape) == ["", "", "/"]


def test_figure_labels_a_reader_sees():
    md = verify.verify_figure(lane_of("mtad", [mtad_step(0)]), 0, 0.1)
    assert md.data[0].name == "log p_j − log q_j" and md.data[0].hovertemplate == "prefix %{x}: %{text}<extra></extra>"
    # a short bar's value label sits above it, past the axis, and log τ's label stays readable over a hatched bar
    assert md.data[0].cliponaxis is False and md.data[0].textposition == "auto"
    assert md.layout.annotations[0].bgcolor == "rgba(255, 255, 255, 0.85)"
    sd = verify.verify_figure(lane_of("sd", [sd_step(0)]), 0, 0.1)
    assert (
        sd.data[0].name == "log p_i − log q_i" and sd.data[0].cliponaxis is False and sd.data[0].textposition == "auto"
    )
    assert sd.layout.xaxis.title.text == "draft token i" and sd.layout.yaxis.title.text == "log"
    empty = verify.verify_figure(None, 0, 0.1)
    assert empty.layout.xaxis.title.text == "" and empty.layout.yaxis.title.text == ""


# --- Spectr, SpecInfer and BiLD: their own rule, not SD's -----------------------------------------


def walk_step(method: str) -> Step:
    """A sampled multi-draft iteration over 2 candidates [<, ↵, a] and [<, b, a]: position 1 accepts '<' at
    the first try, position 2 rejects both tries and draws '>' (id 4) from the residual."""
    step = sd_step(0)
    step.method = method
    step.uniforms = None  # multi-draft steps record their draws in the walk, not here
    step.candidates, step.candidate_kept, step.chosen = [[3, 5, 1], [3, 2, 1]], [1, 1], 0
    step.appended_ids, step.accepted, step.from_target = [3, 4], 1, [False, True]
    second = {"tokens": [5, 2], "p": [0.1, 0.05], "q": [0.4, 0.2], "u": [0.7, 0.8], "accepted": None, "draw": 4}
    if method == "spectr":
        second |= {"rho": 1.25, "residuals": [[[4, 0.5], [6, 0.3], [1, 0.2]]]}
    else:
        second |= {"rho": None, "residuals": [[[4, 0.4], [2, 0.35], [6, 0.1]], [[4, 0.6], [6, 0.3], [1, 0.1]]]}
    first = {"tokens": [3, 3], "p": [0.6], "q": [0.3], "u": [0.2, 0.9], "rho": 1.5 if method == "spectr" else None}
    first |= {"residuals": [], "accepted": 0, "draw": None}
    step.walk = [first, second]
    return step


def test_spectr_table_shows_rho_each_try_the_residual_and_the_draw_and_no_greedy_dash():
    html = verify.verify_html(lane_of("spectr", [walk_step("spectr")]), 0, 0.1, 0.1, FakeTokenizer())
    table = Tables(html).tables[-1]
    assert texts(table[0]) == ["position", "try", "x", "p(x)", "q(x)", "ρ", "min(1, p/(ρq))", "u", "verdict"]
    assert [texts(r) for r in table[1:]] == [
        ["1", "1", "<", "0.6", "0.3", "1.500", "1.000", "0.200", "u below it: accepted"],  # 0.6 / (1.5 · 0.3) > 1
        ["2", "1", "↵", "0.1", "0.4", "1.250", "0.200", "0.700", "u above it: rejected"],  # 0.1 / (1.25 · 0.4)
        ["2", "2", "b", "0.05", "0.2", "1.250", "0.200", "0.800", "u above it: rejected"],
        ["2", "", "K-SEQ's residual: > 0.5 ·   0.3 · a 0.2", ""],
        ["2", "", "no candidate passed: >, drawn from the residual, ends the iteration", "replaced"],
    ]
    assert "(greedy)" not in html and "u_i" not in html


def test_specinfer_table_judges_each_try_against_the_residual_left_by_the_one_before():
    html = verify.verify_html(lane_of("specinfer", [walk_step("specinfer")]), 0, 0.1, 0.1, FakeTokenizer())
    table = Tables(html).tables[-1]
    assert texts(table[0]) == ["position", "try", "x", "p_k(x)", "q(x)", "min(1, p_k/q)", "u", "verdict"]
    assert [texts(r) for r in table[2:]] == [
        ["2", "1", "↵", "0.1", "0.4", "0.250", "0.700", "u above it: rejected"],
        ["2", "", "residual norm(max(0, p_k − q)) now: > 0.4 · b 0.35 ·   0.1", ""],
        ["2", "2", "b", "0.05", "0.2", "0.250", "0.800", "u above it: rejected"],
        ["2", "", "residual norm(max(0, p_k − q)) now: > 0.6 ·   0.3 · a 0.1", ""],
        ["2", "", "no candidate passed: >, drawn from the residual, ends the iteration", "replaced"],
    ]
    assert "ρ" not in texts(table[0])


def test_a_greedy_walk_compares_candidates_with_the_target_s_argmax_without_draws():
    step = walk_step("spectr")
    for t in step.walk:
        t["u"], t["rho"], t["residuals"] = None, None, []
    step.walk[1]["p"], step.walk[1]["q"] = [0.1, 0.05], [0.4, 0.2]
    table = Tables(verify.verify_html(lane_of("spectr", [step]), 0, 0.1, 0.1, FakeTokenizer())).tables[-1]
    assert texts(table[0]) == ["position", "try", "x", "p(x)", "q(x)", "verdict"]
    assert [texts(r)[-1] for r in table[1:]] == [
        "the target's argmax: kept",
        "not the target's argmax",
        "not the target's argmax",
        "replaced",
    ]
    assert texts(table[-1])[2] == "no candidate passed: >, the target's argmax, ends the iteration"


def bild_step(tops: list[float]) -> Step:
    """A BiLD iteration: 3 drafts with target NLLs 0.1, 2.9, 0.5 (the second over τ2 = 2: rolled back)."""
    step = sd_step(0)
    step.method, step.uniforms, step.draft_top_q = "bild", None, tops
    return step


def test_bild_table_shows_the_top_probability_against_tau1_and_each_nll_against_tau2():
    settings = {"tau1": 0.6, "tau2": 2.0}
    html = verify.verify_html(lane_of("bild", [bild_step([0.9, 0.7, 0.65])]), 0, 0.1, 0.1, FakeTokenizer(), settings)
    assert "τ1 = 0.6 (fallback" in html and "τ2 = 2 nats (rollback" in html
    table = Tables(html).tables[-1]
    assert texts(table[0]) == ["i", "x_i", "little model's top q", "NLL −log p_i(x_i)", "vs τ2", "verdict"]
    assert [texts(r) for r in table[1:]] == [
        ["1", "<", "0.900 ≥ τ1", "0.100", "≤ τ2", "kept"],
        ["2", "↵", "0.700 ≥ τ1", "2.900", "> τ2", "rolled back: NLL above τ2"],
        ["3", "a", "0.650 ≥ τ1", "0.500", "≤ τ2", "dropped (after the rollback)"],
    ]
    assert "(greedy)" not in html


def test_bild_fallback_row_says_whether_the_big_model_wrote_that_position():
    step = bild_step([0.9, 0.7, 0.65, 0.3])  # a fourth check, under τ1: the little model stopped drafting
    settings = {"tau1": 0.6, "tau2": 2.0}
    rows = Tables(verify.verify_html(lane_of("bild", [step]), 0, 0.1, 0.1, FakeTokenizer(), settings)).tables[-1]
    assert texts(rows[-1]) == ["4", "—", "0.300 < τ1", "—", "—", "fallback (the rollback came first)"]
    step.accepted, step.appended_ids, step.from_target = 3, [3, 5, 1, 2], [False, False, False, True]
    step.log_p = [-0.1, -0.2, -0.3]
    rows = Tables(verify.verify_html(lane_of("bild", [step]), 0, 0.1, 0.1, FakeTokenizer(), settings)).tables[-1]
    assert texts(rows[-1])[-1] == "fallback: the big model writes this position"


def test_the_panel_says_p_and_q_are_the_warped_distributions_and_why_a_prefix_is_minus_infinity():
    finite = verify.verify_html(lane_of("mtad", [mtad_step(0)]), 0, 0.1, 0.1, FakeTokenizer())
    assert "warped distributions" in finite and "−∞</b> here is log 0" not in finite
    step = mtad_step(0, log_p=(-0.5, -math.inf, -math.inf, -math.inf))
    html = verify.verify_html(lane_of("mtad", [step]), 0, 0.1, 0.1, FakeTokenizer())
    assert "−∞</b> here is log 0: a drafted token lies outside the target's top-k / top-p" in html


def test_walk_figure_draws_each_try_s_acceptance_against_its_draw():
    fig = verify.verify_figure(lane_of("spectr", [walk_step("spectr")]), 0, 0.1)
    bars, draws = fig.data
    assert list(bars.x) == ["1.1", "2.1", "2.2"] and list(bars.y) == pytest.approx([1.0, 0.2, 0.2])
    assert list(draws.y) == [0.2, 0.7, 0.8] and list(bars.marker.color) == [PASS, FAIL, FAIL]
    assert fig.layout.title.text.startswith("Spectr: each try's acceptance min(1, p/(ρq)) against its draw u")
    inf = verify.verify_figure(lane_of("specinfer", [walk_step("specinfer")]), 0, 0.1)
    assert list(inf.data[0].y) == pytest.approx([1.0, 0.25, 0.25]) and "SD" not in inf.layout.title.text


def test_a_rejected_try_the_target_gives_p_zero_keeps_a_visible_bar():
    step = walk_step("spectr")
    step.walk[1]["p"] = [0.0, 0.05]  # the first try at position 2 is outside the warped target
    bars = verify.verify_figure(lane_of("spectr", [step]), 0, 0.1).data[0]
    assert list(bars.x) == ["1.1", "2.1", "2.2"] and bars.y[1] == verify.ZERO_STUB > 0
    assert bars.text[1] == "0 (p = 0)" and list(bars.marker.pattern.shape) == ["", "/", ""]
    assert list(bars.marker.color) == [PASS, FAIL, FAIL] and bars.y[2] == pytest.approx(0.2)


def test_bild_figure_draws_each_nll_against_tau2():
    fig = verify.verify_figure(lane_of("bild", [bild_step([0.9, 0.7, 0.65])]), 0, 0.1, {"tau1": 0.6, "tau2": 2.0})
    assert list(fig.data[0].y) == pytest.approx([0.1, 2.9, 0.5])
    assert list(fig.data[0].marker.color) == [PASS, FAIL, FAIL]
    assert fig.layout.shapes[0].y0 == 2.0 and fig.layout.annotations[0].text == "τ2 = 2"
    assert fig.layout.title.text.startswith("BiLD: each draft token's NLL under the target against τ2")


def test_bild_falling_back_at_once_is_explained_not_called_the_budget_s_last_token():
    step = Step(index=0, method="bild", appended_ids=[2], from_target=[True], target_logprobs=[-1.0])
    step.draft_top_q = [0.15]  # the little model's first check: under τ1, so it drafted nothing
    settings = {"tau1": 0.6, "tau2": 2.0}
    html = verify.verify_html(lane_of("bild", [step]), 0, 0.1, 0.1, FakeTokenizer(), settings)
    assert "budget" not in html
    table = Tables(html).tables[-1]
    assert [texts(r) for r in table[1:]] == [
        ["1", "—", "0.150 < τ1", "—", "—", "fallback: the big model writes this position"]
    ]
    fig = verify.verify_figure(lane_of("bild", [step]), 0, 0.1, settings)
    assert fig.layout.title.text.startswith("BiLD: each draft token's NLL") and list(fig.data[0].y) == []


def test_the_panel_counts_the_lane_s_iterations_with_every_prefix_at_minus_infinity():
    dead = mtad_step(1, log_p=(-math.inf,) * 4)
    lane = lane_of("mtad", [mtad_step(0), dead, mtad_step(2, log_p=(-0.5, -math.inf, -math.inf, -math.inf))])
    html = verify.verify_html(lane, 0, 0.1, 0.1, FakeTokenizer())
    # per position, among the iterations that reached it with every earlier token allowed
    assert (
        "<b>The draft's disagreement</b> in this lane: the warped target excluded the draft's token at position 1 "
        "in 1 of 3 (33%; every prefix at −∞ there), at position 2 in 1 of 2 (50%) of the iterations that reached "
        "that position with every earlier token allowed." in html
    )
    assert "disagreement" not in verify.verify_html(lane_of("mtad", [mtad_step(0)]), 0, 0.1, 0.1)


def test_bild_shows_a_rounding_above_log_one_as_zero_nll_not_minus_zero():
    step = bild_step([1.0, 1.0, 1.0])
    step.log_p, step.accepted = [1e-7, 2e-7, 3e-7], 3  # float32 log-softmax of a sure token can round above 0
    step.appended_ids, step.from_target = [3, 5, 1, 2], [False, False, False, True]
    html = verify.verify_html(lane_of("bild", [step]), 0, 0.1, 0.1, FakeTokenizer(), {"tau1": 0.9, "tau2": 2.0})
    assert [texts(r)[3] for r in Tables(html).tables[-1][1:]] == ["0.000"] * 3 and "-0.000" not in html
