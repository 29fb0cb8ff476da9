"""The waiting line the page shows, read from Gradio's own queue: every queued run, the page's or the API's.

Gradio's queue holds the jobs waiting for the device (one concurrency id, one run at a time); a page
visitor's place is their job's place in it, counted with every other job there (another visitor's,
or an API client's ``/run``). A job Gradio refused (its queue full) is never in it: the page says so
instead of "waiting". No wait-time estimate is made: a run's length depends on its prompt, settings and
pair, so the page says how long the current run has been going instead.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEVICE = "device"  # the concurrency id of every run event (app.py)
PAGE_RUN = "run_page"  # the name of the page's Run handler (mtad.ui.run.run_page): one per page at a time
GRACE = 3.0  # seconds a pressed Run may take to reach Gradio's queue before it counts as refused


@dataclass(frozen=True)
class Jobs:
    """Gradio's queue as of now: the device's queued jobs in order and its running ones."""

    pending: list[str] = field(default_factory=list)  # session of each queued device job, first first
    api: list[bool] = field(default_factory=list)  # per queued job: True when it came from the API
    active: list[str] = field(default_factory=list)  # sessions of the device jobs running now
    size: int = 0  # queued jobs of any kind: what Gradio's max_size counts
    max_size: int | None = None
    page_runs: list[str] = field(default_factory=list)  # sessions of the page's Run jobs, queued or running

    @property
    def full(self) -> bool:
        """True when Gradio refuses the next job."""
        return self.max_size is not None and self.size >= self.max_size


def gradio_jobs(blocks: object, concurrency_id: str = DEVICE) -> Jobs | None:
    """Read the queue of a launched ``gr.Blocks`` (``Blocks._queue``: Gradio 6 keeps each concurrency id's
    waiting ``Event``s in ``event_queue_per_concurrency_id`` and the running ones in ``active_jobs``); None
    where that is not there to read (the line then falls back to the page's own Run presses)."""
    q = getattr(blocks, "_queue", None)
    try:
        line = q.event_queue_per_concurrency_id.get(concurrency_id)
        events = list(line.queue) if line is not None else []
        running = [e for job in list(q.active_jobs) if job for e in job if e.concurrency_id == concurrency_id]
    except AttributeError:
        return None
    return Jobs(
        pending=[e.session_hash for e in events],
        api=[e.fn.api_visibility != "private" for e in events],
        active=[e.session_hash for e in running],
        size=len(q),
        max_size=q.max_size,
        page_runs=[e.session_hash for e in [*events, *running] if getattr(e.fn, "name", None) == PAGE_RUN],
    )


@dataclass(frozen=True)
class Place:
    """A waiting visitor's place: 1-based position among the runs not yet finished, and the run ahead.

    ``state``: ``waiting`` (in Gradio's queue), ``joining`` (Run pressed a moment ago, not queued yet) or
    ``refused`` (never queued: Gradio's queue was full)."""

    position: int
    total: int
    running_for: float | None  # seconds the run holding the device has been going; None when none is
    api: int = 0  # of the jobs ahead, how many came from the API
    state: str = "waiting"
    max_size: int | None = None


class WaitingLine:
    """Sessions that pressed Run and have not started yet, the running ones, and, once :meth:`attach`
    names the page, Gradio's queue as the truth about who waits ahead of whom."""

    def __init__(self, jobs: Callable[[], Jobs | None] | None = None) -> None:
        self._waiting: dict[str, float] = {}
        self._running: dict[str, float] = {}
        self._left: set[str] = set()  # stopped while waiting: their job is still queued but decodes nothing
        self._lock = threading.Lock()
        self.jobs = jobs

    def attach(self, blocks: object) -> None:
        """Read positions from this page's Gradio queue."""
        self.jobs = lambda: gradio_jobs(blocks)

    def join(self, session: str) -> None:
        """A Run press: the session goes to the end of the line (again, if it was already waiting)."""
        with self._lock:
            self._waiting.pop(session, None)
            self._left.discard(session)
            self._waiting[session] = time.monotonic()

    def start(self, session: str) -> None:
        """The session's run holds the device now."""
        with self._lock:
            self._waiting.pop(session, None)
            self._left.discard(session)
            self._running[session] = time.monotonic()

    def leave(self, session: str, stopped: bool = False) -> None:
        """The session's run ended, its tab closed, or (``stopped``) Stop took it out of the line: its job
        may still sit in Gradio's queue, but it will decode nothing, so nobody counts it."""
        with self._lock:
            was_waiting = self._waiting.pop(session, None) is not None
            self._running.pop(session, None)
            if stopped and was_waiting:
                self._left.add(session)

    def place(self, session: str) -> Place | None:
        """Where a waiting session stands; None when it is not waiting (running, done or unknown)."""
        with self._lock:
            if session not in self._waiting:
                return None
            now = time.monotonic()
            running_for = now - min(self._running.values()) if self._running else None
            joined = self._waiting[session]
            jobs = self.jobs() if self.jobs is not None else None
            if jobs is None:  # no queue to read (a page not launched): the Run presses in order
                ahead = list(self._waiting).index(session)
                n_running = len(self._running)
                return Place(n_running + ahead + 1, n_running + len(self._waiting), running_for)
            left = set(self._left)
        queued = [(s, api) for s, api in zip(jobs.pending, jobs.api, strict=True) if s not in left]
        n_running = len(jobs.active)
        sessions = [s for s, _ in queued]
        if session in sessions:
            k = sessions.index(session)
            api = sum(a for _, a in queued[:k])
            return Place(n_running + k + 1, n_running + len(queued), running_for, api, "waiting", jobs.max_size)
        if session in jobs.active:
            return None  # started: the run itself takes over the page
        state = "joining" if now - joined < GRACE else "refused"
        api = sum(a for _, a in queued)
        return Place(n_running + len(queued) + 1, n_running + len(queued) + 1, running_for, api, state, jobs.max_size)

    def busy(self, session: str) -> bool:
        """True while a page Run of the session is queued or running (in Gradio's queue, else the page's own
        Run presses): a Run press then queues nothing new (Gradio's "once" rule)."""
        jobs = self.jobs() if self.jobs is not None else None
        if jobs is not None:
            return session in jobs.page_runs
        with self._lock:
            return session in self._waiting or session in self._running

    def must_wait(self, session: str) -> bool:
        """True when a run holds the device or someone joined before this session."""
        p = self.place(session)
        return p is not None and p.position > 1


def place_text(place: Place) -> str:
    """A waiting visitor's place in words, without a made-up estimate."""
    if place.state == "refused":
        runs = "run" if place.max_size == 1 else "runs"
        most = f" ({place.max_size} {runs} waiting, the most this server keeps)" if place.max_size is not None else ""
        return (
            f"The queue is full{most}: your run was not queued and nothing is waiting for you. "
            "Press Run again in a while."
        )
    ahead = place.position - 1
    runs = "run" if ahead == 1 else "runs"
    api = f", {place.api} of them from the API" if place.api else ""
    going = f"; the current run has been going for {place.running_for:.0f} s" if place.running_for is not None else ""
    if place.state == "joining":
        return f"Joining the queue ({ahead} {runs} ahead of you{api}{going})…"
    return (
        f"Waiting in the queue: you are number {place.position} of {place.total} "
        f"({ahead} {runs} ahead of you{api}{going}). Your run starts by itself when the device is free; "
        "Stop leaves the queue."
    )


def full_text(jobs: Jobs) -> str:
    """What a visitor reads when Run meets a full queue."""
    runs = "run" if jobs.size == 1 else "runs"
    return (
        f"the queue is full ({jobs.size} {runs} waiting, the most this server keeps): your run was not queued "
        "and nothing is waiting for you. Press Run again in a while"
    )


JOBS_PER_SESSION_DEFAULT = 2  # a page's run and its "Fastest", or an API client's run and the next
JOBS_PER_ADDRESS_DEFAULT = 4  # a few tabs or people behind one address


def per_client_caps() -> tuple[int, int]:
    """The operator's caps on device jobs queued or running per session and per client address
    (``MTAD_JOBS_PER_SESSION``, ``MTAD_JOBS_PER_ADDRESS``; 0: no cap), read at every job."""
    caps = []
    for name, default in (
        ("MTAD_JOBS_PER_SESSION", JOBS_PER_SESSION_DEFAULT),
        ("MTAD_JOBS_PER_ADDRESS", JOBS_PER_ADDRESS_DEFAULT),
    ):
        raw = os.environ.get(name, "").strip()
        caps.append(max(0, int(raw)) if raw.isdigit() else default)
    return caps[0], caps[1]


def address_of(request: object) -> str | None:
    """The client address of a Gradio event's HTTP request (None where there is none)."""
    client = getattr(request, "client", None)
    return getattr(client, "host", None)


def client_refusal(jobs: list[tuple[str, str | None]], session: str | None, address: str | None) -> str | None:
    """Why a new device job of ``session`` from ``address`` is refused, given the (session, address) of every
    device job queued or running; None when it may join the queue."""
    per_session, per_address = per_client_caps()
    mine = sum(1 for s, _ in jobs if s == session)
    if per_session and session is not None and mine >= per_session:
        runs = "run" if per_session == 1 else "runs"
        return (
            f"this session already has {mine} {runs} queued or running, the most this server takes from one "
            "session: wait for one to end"
        )
    near = sum(1 for _, a in jobs if a == address)
    if per_address and address is not None and near >= per_address:
        return (
            f"your address already has {near} runs queued or running, the most this server takes from one "
            "address: wait for one to end"
        )
    return None


def limit_per_client(blocks: object, concurrency_id: str = DEVICE) -> None:
    """Refuse a device job at the door of Gradio's queue when its session or its client address already has
    as many queued or running as :func:`per_client_caps` allows, so that one client cannot fill the queue
    (HTTP 503 with the reason as its detail; a Gradio client reads it as a full queue). Wraps
    ``Blocks._queue.push``, Gradio 6's one entry to the queue."""
    q = blocks._queue
    push = q.push

    async def limited(body: object, request: object, username: str | None) -> tuple:
        fn_index = getattr(body, "fn_index", None)
        fn = blocks.fns.get(fn_index) if fn_index is not None else None
        if fn is not None and fn.concurrency_id == concurrency_id:
            line = q.event_queue_per_concurrency_id.get(concurrency_id)
            events = list(line.queue) if line is not None else []
            events += [e for job in list(q.active_jobs) if job for e in job if e.concurrency_id == concurrency_id]
            jobs = [(e.session_hash, address_of(e.request)) for e in events]
            why = client_refusal(jobs, getattr(body, "session_hash", None), address_of(request))
            if why is not None:
                return False, why, "queue_full"
        return await push(body=body, request=request, username=username)

    q.push = limited
