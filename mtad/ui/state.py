"""The page's state shared by every visitor, held in one object: the loaded model pairs, each session's
Stop flag and the waiting line. Handlers read it through :data:`PAGE`; nothing else of the page keeps
state between events (a visitor's own run lives in the page's ``gr.State``)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from mtad.ui.runner import PairCache
from mtad.ui.waiting import WaitingLine


class CancelRegistry:
    """The Stop flags of each browser session's runs: one armed when Run is pressed (so Stop reaches the run
    while it is queued), one per run going. Stop sets every flag of the session, so it reaches every run the
    session started, whichever press queued it. At most ``max_sessions`` armed flags are kept (the oldest go
    first): session keys come from clients, and a flag whose run never came must not stay for ever."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._armed: OrderedDict[str, threading.Event] = OrderedDict()
        self._running: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()

    def arm(self, session: str) -> threading.Event:
        """A fresh flag for the run a Run press queues (the page asks only when no run of the session is queued
        or going: a second press must neither hide the first run from Stop nor undo a Stop already pressed)."""
        with self._lock:
            ev = threading.Event()
            self._armed[session] = ev
            self._armed.move_to_end(session)
            while len(self._armed) > self.max_sessions:
                self._armed.popitem(last=False)
            return ev

    def take(self, session: str) -> threading.Event:
        """The flag a starting run watches until :meth:`release`: the one armed for it, else a fresh one (an
        API run is queued without a press)."""
        with self._lock:
            ev = self._armed.pop(session, None) or threading.Event()
            self._running.setdefault(session, set()).add(ev)
            return ev

    def release(self, session: str, ev: threading.Event) -> None:
        """The run watching ``ev`` ended: Stop no longer has anything of it to stop."""
        with self._lock:
            flags = self._running.get(session)
            if flags is not None:
                flags.discard(ev)
                if not flags:
                    del self._running[session]

    def stop(self, session: str) -> bool:
        """Set every flag of the session's queued and running runs; True if there was one."""
        with self._lock:
            flags = [*self._running.get(session, ()), *([self._armed[session]] if session in self._armed else [])]
        for ev in flags:
            ev.set()
        return bool(flags)

    def forget(self, session: str) -> None:
        """A closed tab: its armed flag goes (its runs release their own)."""
        with self._lock:
            self._armed.pop(session, None)

    def __len__(self) -> int:
        """Sessions holding a flag (armed or running)."""
        with self._lock:
            return len(set(self._armed) | set(self._running))


@dataclass
class PageState:
    """What the page's handlers share: pairs loaded once per process (``MTAD_MAX_LOADED_PAIRS`` of them),
    one Stop flag per browser session and the line of runs waiting for the device."""

    pairs: PairCache = field(default_factory=lambda: PairCache(int(os.environ.get("MTAD_MAX_LOADED_PAIRS", "1"))))
    cancels: CancelRegistry = field(default_factory=CancelRegistry)
    line: WaitingLine = field(default_factory=WaitingLine)
    preloaded: dict[str, threading.Thread] = field(default_factory=dict)  # pairs loading since start-up


PAGE = PageState()


def session_of(request: object | None) -> str:
    """The browser session an event came from (``"api"`` for an API client without one), at most
    ``SESSION_KEY_CHARS`` characters of it: the client chooses it, and the page keeps state per key."""
    session = (getattr(request, "session_hash", None) if request is not None else None) or "api"
    return str(session)[:SESSION_KEY_CHARS]


SESSION_KEY_CHARS = 64
