"""The waiting line the page shows: who pressed Run, in order, and which run holds the device.

Gradio's queue runs one generation at a time; this mirrors it for the visitors of the page so a
waiting visitor can be told their position. No wait-time estimate is made: a run's length depends on
its prompt, settings and pair, so the page says how long the current run has been going instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """A waiting visitor's place: 1-based position among the runs not yet finished, and the run ahead."""

    position: int
    total: int
    running_for: float | None  # seconds the run holding the device has been going; None when none is


class WaitingLine:
    """Sessions that pressed Run and have not started yet, in arrival order, plus the running one."""

    def __init__(self) -> None:
        self._waiting: dict[str, float] = {}
        self._running: dict[str, float] = {}
        self._lock = threading.Lock()

    def join(self, session: str) -> None:
        """A Run press: the session goes to the end of the line (again, if it was already waiting)."""
        with self._lock:
            self._waiting.pop(session, None)
            self._waiting[session] = time.monotonic()

    def start(self, session: str) -> None:
        """The session's run holds the device now."""
        with self._lock:
            self._waiting.pop(session, None)
            self._running[session] = time.monotonic()

    def leave(self, session: str) -> None:
        """The session's run ended, was stopped while waiting, or its tab closed."""
        with self._lock:
            self._waiting.pop(session, None)
            self._running.pop(session, None)

    def place(self, session: str) -> Place | None:
        """Where a waiting session stands; None when it is not waiting (running, done or unknown)."""
        with self._lock:
            if session not in self._waiting:
                return None
            ahead = list(self._waiting).index(session)
            now = time.monotonic()
            running_for = now - min(self._running.values()) if self._running else None
            n_running = len(self._running)
            return Place(position=n_running + ahead + 1, total=n_running + len(self._waiting), running_for=running_for)

    def must_wait(self, session: str) -> bool:
        """True when a run holds the device or someone joined before this session."""
        p = self.place(session)
        return p is not None and p.position > 1


def place_text(place: Place) -> str:
    """A waiting visitor's place in words, without a made-up estimate."""
    ahead = place.position - 1
    runs = "run" if ahead == 1 else "runs"
    going = f"; the current run has been going for {place.running_for:.0f} s" if place.running_for is not None else ""
    return (
        f"Waiting in the queue: you are number {place.position} of {place.total} "
        f"({ahead} {runs} ahead of you{going}). Your run starts by itself when the device is free; "
        "Stop leaves the queue."
    )


LINE = WaitingLine()
