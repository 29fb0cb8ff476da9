"""The page's state shared by every visitor, held in one object: the loaded model pairs, each session's
Stop flag and the waiting line. Handlers read it through :data:`PAGE`; nothing else of the page keeps
state between events (a visitor's own run lives in the page's ``gr.State``)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from mtad.ui.runner import PairCache
from mtad.ui.waiting import WaitingLine


class CancelRegistry:
    """One Stop flag per browser session: armed when Run is pressed, set by Stop or a closed tab."""

    def __init__(self) -> None:
        self._flags: dict[str, tuple[threading.Event, bool]] = {}
        self._lock = threading.Lock()

    def arm(self, session: str) -> threading.Event:
        """A fresh flag for the session's next run (set it to stop that run even while it is queued)."""
        with self._lock:
            ev = threading.Event()
            self._flags[session] = (ev, False)
            return ev

    def take(self, session: str) -> threading.Event:
        """The flag a starting run watches: the armed one if unused, else a fresh one."""
        with self._lock:
            ev, used = self._flags.get(session, (None, True))
            if ev is None or used:
                ev = threading.Event()
            self._flags[session] = (ev, True)
            return ev

    def stop(self, session: str) -> bool:
        """Set the session's flag; True if there was one."""
        with self._lock:
            entry = self._flags.get(session)
        if entry is None:
            return False
        entry[0].set()
        return True

    def forget(self, session: str) -> None:
        with self._lock:
            self._flags.pop(session, None)


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
    """The browser session an event came from (``"api"`` for an API client without one)."""
    return (getattr(request, "session_hash", None) if request is not None else None) or "api"
