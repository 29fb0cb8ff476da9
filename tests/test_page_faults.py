"""Faults a visitor's ordinary actions inject into the page's handlers: Run pressed twice then Stop, Stop while
queued then Run, Stop after the run ended, prompts too long or not text, a refusal quoting Markdown, and the
per-session state that must stay bounded. The handlers are called as the page calls them (app.py's wiring),
on a presets file naming the tiny pair; Gradio's queue, where it matters, is the ``Jobs`` it would report."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import markdown_it
import pytest

from mtad.events import Step
from mtad.ui import line, runner
from mtad.ui import run as runs
from mtad.ui.outputs import markdown_text
from mtad.ui.state import PAGE, SESSION_KEY_CHARS, CancelRegistry, session_of
from mtad.ui.waiting import Jobs, client_refusal

FORM = dict(
    prompt="abc def abc",
    pair_name="tiny",
    tau=0.1,
    beams=4,
    gamma=3,
    max_new_tokens=100,
    greedy=False,
    temperature=1.0,
    top_k=20,
    top_p=0.9,
    seed=7,
    with_ar=False,
    left="sd",
    right="mtad",
    num_drafts=4,
    tau1=0.9,
    tau2=2.0,
)


@pytest.fixture(scope="module")
def tiny_presets(tiny_presets: Path) -> Path:
    """The shared presets, the tiny pair loaded before the timed runs."""
    PAGE.pairs.get("tiny")
    return tiny_presets


def endless_decode(pair, prompt_ids, settings):  # noqa: ANN001, ANN201
    """A decoder that never reaches EOS (one token per 10 ms): only Stop ends its lane."""
    i = 0
    while True:
        time.sleep(0.01)
        yield Step(index=i, method=settings.method, appended_ids=[1], from_target=[True], target_logprobs=[-1.0])
        i += 1


def request(session: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=session)


class PageRun(threading.Thread):
    """The page's run event in a thread, as Gradio runs it once ``arm`` has queued it."""

    def __init__(self, session: str, **changes: object) -> None:
        super().__init__(daemon=True)
        self.session, self.form, self.outputs = session, {**FORM, **changes}, []

    def run(self) -> None:
        self.outputs = list(runs.run_page(request(self.session), **self.form))

    def record(self):  # noqa: ANN201
        return self.outputs[-1][-2]


def wait_until(condition, seconds: float = 30.0) -> bool:  # noqa: ANN001
    for _ in range(int(seconds / 0.02)):
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def queue_of(monkeypatch):  # noqa: ANN001, ANN201
    """Gradio's queue as the page reads it: the sessions whose page runs are queued or running now."""
    jobs = {"pending": [], "active": []}
    monkeypatch.setattr(
        PAGE.line,
        "jobs",
        lambda: Jobs(
            pending=list(jobs["pending"]),
            api=[False] * len(jobs["pending"]),
            active=list(jobs["active"]),
            size=len(jobs["pending"]),
            max_size=16,
            page_runs=[*jobs["pending"], *jobs["active"]],
        ),
    )
    return jobs


def test_run_pressed_twice_then_stop_stops_the_run(tiny_presets, monkeypatch, queue_of) -> None:  # noqa: ANN001
    monkeypatch.setattr(runner, "decode", endless_decode)
    s = "twice"
    line.arm("sd", "mtad", request(s))
    first = PageRun(s)
    queue_of["active"].append(s)
    first.start()
    assert wait_until(lambda: any(w.is_alive() for w in list(runner.ACTIVE))), first.outputs[:1]
    pressed = line.arm("sd", "mtad", request(s))  # the second press: Gradio queues no second run
    assert "still queued or running" in pressed[0]
    line.stop("sd", "mtad", request(s))
    first.join(30)
    assert not first.is_alive(), "Stop missed the run: it went on after a second Run press replaced its flag"
    queue_of["active"].clear()
    rec = first.record()
    assert rec.lanes["sd"].state == "stopped" and rec.lanes["mtad"].state == "stopped"
    assert wait_until(lambda: not runner.DEVICE_LOCK.locked())


def test_stop_while_queued_then_run_does_not_run_the_old_prompt(tiny_presets, monkeypatch, queue_of) -> None:  # noqa: ANN001
    s = "queued"
    line.arm("sd", "mtad", request(s))
    queue_of["pending"].append(s)  # queued behind another visitor's run
    line.stop("sd", "mtad", request(s))
    pressed = line.arm("sd", "mtad", request(s))  # the prompt edited, Run pressed while the old job still waits
    assert "still queued or running" in pressed[0]
    queue_of["pending"].clear()
    queue_of["active"].append(s)
    old = PageRun(s, max_new_tokens=6)  # the old job reaches the device
    old.run()
    assert old.outputs[-1][1] == "Stopped before start." and old.outputs[-1][-2] is None


def test_stop_after_the_run_ended_says_nothing_is_running(tiny_presets) -> None:  # noqa: ANN001
    s = "ended"
    line.arm("sd", "mtad", request(s))
    done = PageRun(s, max_new_tokens=4)
    done.run()
    assert done.record().lanes["mtad"].state == "done"
    shown = line.stop("sd", "mtad", request(s))
    assert "nothing is running" in shown[0] and "Stop pressed" not in shown[0]
    assert len(PAGE.cancels) == 0 or s not in PAGE.cancels._running


def test_a_sessions_stop_reaches_every_run_it_has_going() -> None:
    reg = CancelRegistry()
    a, b = reg.take("api-client"), reg.take("api-client")  # two /run jobs of one client, running
    other = reg.take("someone-else")
    assert reg.stop("api-client") and a.is_set() and b.is_set() and not other.is_set()
    reg.release("api-client", a)
    reg.release("api-client", b)
    assert not reg.stop("api-client")  # nothing left to stop


def test_the_cancel_registry_stays_bounded() -> None:
    reg = CancelRegistry(max_sessions=100)
    for i in range(1000):  # presses whose runs never came (refused at the queue's door)
        reg.arm(f"s{i}")
    assert len(reg) == 100
    for i in range(1000):  # runs that came and went
        reg.release(f"r{i}", reg.take(f"r{i}"))
    assert len(reg) == 100
    assert len(session_of(request("x" * 100_000))) == SESSION_KEY_CHARS


# --- prompts ----------------------------------------------------------------------------------------------------


def refusal(**changes: object) -> tuple:
    """The run's one refusal output (message, status) for these form values."""
    out = list(runs.run_page(request("refused"), **{**FORM, **changes}))
    assert len(out) == 1, "the run was not refused"
    return out[0][0], out[0][1]


def test_a_huge_prompt_is_refused_by_its_length_before_tokenizing(tiny_presets, monkeypatch) -> None:  # noqa: ANN001
    calls = []
    monkeypatch.setattr(runs, "encode_prompt", lambda *a, **k: calls.append(a) or [1])
    message, status = refusal(prompt="abc " * 1_000_000)
    assert "the prompt is 4,000,000 characters long; this server takes at most 20,000 characters" in message
    assert not calls, "the prompt was tokenized before its length was checked"
    monkeypatch.setenv("MTAD_MAX_PROMPT_CHARS", "10")
    assert "at most 10 characters" in refusal(prompt="abc def abc")[0]


def test_a_lone_surrogate_is_a_sentence(tiny_presets) -> None:  # noqa: ANN001
    message, _ = refusal(prompt="pasted \ud800 text")
    assert "U+D800, a lone surrogate, at character 8" in message and "paste the text again" in message


def test_a_refusal_quoting_markdown_renders_as_plain_text(tiny_presets) -> None:  # noqa: ANN001
    value = "[Log in here](https://evil.example/login) ![x](https://evil.example/x.png) **b** <i>i</i>"
    _, status = refusal(tau=value)
    rendered = markdown_it.MarkdownIt("commonmark").render(status)
    assert "<a " not in rendered and "<img" not in rendered and "<strong>" not in rendered and "<i>" not in rendered
    assert "https://evil.example/login" not in status  # no bare URL for a linkifier either
    assert value.replace("<", "&lt;").replace(">", "&gt;") in rendered


def test_markdown_text_escapes_what_html_escaping_alone_leaves_live() -> None:
    from html import escape

    md = markdown_it.MarkdownIt("commonmark")
    value = "[Log in here](https://evil.example)"
    assert "<a " in md.render(escape(value))  # the control: HTML escaping alone still makes a link
    assert "<a " not in md.render(markdown_text(value))
    assert md.render(markdown_text("a\n# b")) == "<p>a # b</p>\n"


def test_client_refusal_caps_jobs_per_session_and_per_address(monkeypatch) -> None:  # noqa: ANN001
    jobs = [("a", "1.1.1.1"), ("a", "1.1.1.1"), ("b", "2.2.2.2")]
    assert "this session already has 2 runs" in client_refusal(jobs, "a", "9.9.9.9")
    assert client_refusal(jobs, "c", "2.2.2.2") is None
    jobs += [("c", "2.2.2.2"), ("d", "2.2.2.2"), ("e", "2.2.2.2")]
    assert "your address already has 4 runs" in client_refusal(jobs, "f", "2.2.2.2")
    monkeypatch.setenv("MTAD_JOBS_PER_ADDRESS", "0")
    assert client_refusal(jobs, "f", "2.2.2.2") is None


def test_a_link_with_a_prompt_over_the_cap_says_so_instead_of_cutting_it(tiny_presets) -> None:  # noqa: ANN001
    from mtad.ui import link
    from mtad.ui.form import FIELDS

    long = SimpleNamespace(query_params={"prompt": "a" * 20_001, "tau": "0.2"})
    *outs, wanted, message = link.from_query("tiny", long)
    fields = dict(zip(FIELDS, outs, strict=True))
    assert "prompt is 20,001 characters long; this server takes at most 20,000, so it was not put" in message
    assert fields["prompt"] == {"__type__": "update"} and fields["tau"]["value"] == 0.2  # the box is left alone
    *outs, _, message = link.from_query("tiny", SimpleNamespace(query_params={"prompt": "a" * 20_000}))
    assert dict(zip(FIELDS, outs, strict=True))["prompt"]["value"] == "a" * 20_000 and "Opened from a link" in message


def test_the_queue_tells_a_page_run_from_another_device_job(tiny_presets) -> None:  # noqa: ANN001
    """A session whose "Fastest" holds the device may still queue a run: only a page Run blocks the next."""
    from mtad.ui.waiting import PAGE_RUN, gradio_jobs

    def event(session: str, name: str) -> SimpleNamespace:
        fn = SimpleNamespace(name=name, api_visibility="private")
        return SimpleNamespace(session_hash=session, fn=fn, concurrency_id="device")

    class Queue(SimpleNamespace):  # the attributes of Gradio's queue that the line reads
        def __len__(self) -> int:
            return 1

    q = Queue(
        event_queue_per_concurrency_id={"device": SimpleNamespace(queue=[event("a", "fastest_page")])},
        active_jobs=[[event("b", "run_page")]],
        max_size=16,
    )
    jobs = gradio_jobs(SimpleNamespace(_queue=q))
    assert jobs.page_runs == ["b"] and jobs.pending == ["a"] and jobs.active == ["b"]
    assert runs.run_page.__name__ == PAGE_RUN  # the name Gradio gives the page's Run job
