"""Soak the page before a release: ``python scripts/soak.py --clients 4 --minutes 20``.

Starts ``python app.py`` (the embedded pair, ``MTAD_PAIR=embedded``) with ``MTAD_POWERCAP_ROOT`` on a fake RAPL
tree whose counter this script advances, then runs N ``gradio_client`` clients for M minutes, each mixing
normal runs, Stop (a cancelled job), Run twice, bad and oversized prompts, a lone surrogate and an energy
counter that vanishes mid-run. It prints how many requests were served, refused with a message, refused
without one (a bare "Error"), stranded (no answer within ``--stranded-after`` seconds: must be 0), the
tracebacks in the server's log (must be 0) and the server's memory (RSS) each minute, with its growth over the
second half (must stay under ``--max-growth``). Exit status 1 when anything was stranded, refused without a
message or logged a traceback, or the memory kept growing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANGE_UJ = 262_143_328_850
JSON = {"content-type": "application/json"}
OUTCOMES = ("served", "refused with a message", "refused without a message", "stranded")


def fake_powercap(root: Path) -> Path:
    """One RAPL package zone laid out as Linux does under /sys/class/powercap; its counter file."""
    zone = root / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
    counter = zone / "energy_uj"
    counter.write_text("0\n")
    return counter


class Counter_:
    """The fake counter: advances 1 J every 0.1 s; :meth:`break_for` removes its file for a while."""

    def __init__(self, path: Path) -> None:
        self.path, self.value, self.broken_until = path, 0, 0.0
        self.lock = threading.Lock()

    def tick(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            with self.lock:
                self.value += 1_000_000
                if time.monotonic() >= self.broken_until:
                    tmp = self.path.with_suffix(".tmp")
                    tmp.write_text(f"{self.value}\n")
                    os.replace(tmp, self.path)

    def break_for(self, seconds: float) -> None:
        with self.lock:
            self.broken_until = time.monotonic() + seconds
            self.path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB (Linux /proc)."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    return float("nan")


def growth_per_minute(rss: list[float]) -> float | None:
    """MiB a minute the memory grew from the soak's middle to its end (the first half warms caches and
    allocators up); None below four one-minute samples."""
    if len(rss) < 4:
        return None
    half = len(rss) // 2
    return (rss[-1] - rss[half]) / (len(rss) - 1 - half)


def run_args(prompt: str, max_new: int, **changes: object) -> list:
    """``/run``'s inputs in order (tests/test_app_client.py lists them)."""
    values = dict(
        prompt=prompt,
        pair="embedded",
        tau=0.1,
        beams=2,
        gamma=2,
        max_new=max_new,
        greedy=False,
        temperature=1.0,
        top_k=20,
        top_p=0.9,
        seed=7,
        with_ar=False,
        left="sd",
        right="mtad",
        num_drafts=2,
        tau1=0.9,
        tau2=2.0,
    )
    values.update(changes)
    return list(values.values())


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, counter: Counter_) -> None:
        self.url, self.args, self.counter = url, args, counter
        self.tally: Counter = Counter()
        self.by_action: Counter = Counter()
        self.examples: dict[str, str] = {}
        self.lock = threading.Lock()

    def note(self, action: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.tally[outcome] += 1
            self.by_action[(action, outcome)] += 1
            if outcome != "served" and (outcome, action) not in self.examples:
                self.examples[(outcome, action)] = detail[:160]

    def outcome(self, action: str, job: object) -> None:
        """Wait for a job's answer and file it."""
        from gradio_client import exceptions, utils

        try:
            job.result(timeout=self.args.stranded_after)
        except TimeoutError:
            self.note(action, "stranded", "no answer")
        except (exceptions.AppError, utils.QueueError) as exc:
            text = str(exc).strip()
            bare = not text or text in ("Error", "None") or "Traceback" in text
            self.note(action, "refused without a message" if bare else "refused with a message", text)
        except Exception as exc:  # noqa: BLE001 - whatever the client raised is filed, not fatal to the soak
            if job.status().code.name == "CANCELLED":
                self.note(action, "served", "cancelled")
            else:
                self.note(action, "refused without a message", f"{type(exc).__name__}: {exc}")
        else:
            self.note(action, "served")

    def raw_outcome(self, action: str, data: list) -> None:
        """Send ``/run`` through Gradio's plain HTTP API (``/gradio_api/call/run``) and file its answer."""
        import httpx

        try:
            body = json.dumps({"data": data})  # ASCII with escapes: a lone surrogate travels as \ud800
            posted = httpx.post(f"{self.url}gradio_api/call/run", content=body, headers=JSON, timeout=30)
            if posted.is_error:  # refused at the door: the queue full, or too many runs of this client
                detail = (
                    str(posted.json().get("detail", "")) if "json" in posted.headers.get("content-type", "") else ""
                )
                self.note(action, "refused with a message" if detail else "refused without a message", detail)
                return
            posted.raise_for_status()
            event = posted.json()["event_id"]
            text = httpx.get(f"{self.url}gradio_api/call/run/{event}", timeout=self.args.stranded_after).text
        except httpx.TimeoutException:
            self.note(action, "stranded", "no answer")
            return
        except httpx.HTTPError as exc:
            self.note(action, "refused without a message", f"{type(exc).__name__}: {exc}")
            return
        if "event: complete" in text:
            self.note(action, "served")
            return
        detail = text.split("event: error", 1)[-1].partition("data:")[2].strip()
        message = json.loads(detail) if detail.startswith('"') else detail
        bare = not message or message in ("null", "None", "Error")
        self.note(action, "refused without a message" if bare else "refused with a message", str(message))

    def client(self, seed: int, deadline: float) -> None:
        from gradio_client import Client

        rng = random.Random(seed)
        client = Client(self.url, verbose=False)
        new = self.args.max_new_tokens
        while time.monotonic() < deadline:
            action = rng.choice(self.args.actions)
            prompt = rng.choice(["Write a short poem about the sea.", "List three prime numbers.", "abc def"])
            if action == "run":
                self.outcome(action, client.submit(*run_args(prompt, new), api_name="/run"))
            elif action == "stop":
                job = client.submit(*run_args(prompt, 4 * new), api_name="/run")
                time.sleep(rng.uniform(0.2, 3.0))
                job.cancel()
                self.outcome(action, job)
            elif action == "twice":
                jobs = [client.submit(*run_args(prompt, new), api_name="/run") for _ in range(2)]
                for job in jobs:
                    self.outcome(action, job)
            elif action == "bad":
                bad = rng.choice([dict(tau="[Log in here](https://evil.example)"), dict(pair="../x"), dict(beams=-3)])
                if rng.random() < 0.3:
                    prompt = "  "
                self.outcome(action, client.submit(*run_args(prompt, new, **bad), api_name="/run"))
            elif action == "huge":
                self.outcome(action, client.submit(*run_args("abc " * 250_000, new), api_name="/run"))
            elif action == "surrogate":  # JSON can carry one (escaped); gradio_client cannot encode it
                self.raw_outcome(action, run_args("pasted \ud800 text", new))
            else:
                job = client.submit(*run_args(prompt, new), api_name="/run")
                time.sleep(rng.uniform(0.5, 2.0))
                self.counter.break_for(rng.uniform(1.0, 5.0))
                self.outcome(action, job)


ACTIONS = ("run", "stop", "twice", "bad", "huge", "surrogate", "counter")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--stranded-after", type=float, default=600.0, help="seconds without an answer")
    parser.add_argument("--log", type=Path, default=None, help="the server's log (default: a temporary file)")
    parser.add_argument(
        "--sessions",
        type=int,
        default=64,
        help="the server's MTAD_MAX_SESSIONS: every plain-HTTP request opens a session, and the soak reaches this "
        "cap in its first minutes, so that its second half measures what grows beyond the state the server keeps",
    )
    parser.add_argument(
        "--max-growth",
        type=float,
        default=2.0,
        help="MiB a minute the server's memory may grow over the soak's second half (after warming up)",
    )
    parser.add_argument(
        "--actions",
        type=lambda text: text.split(","),
        default=["run", "run", *ACTIONS],
        help="what the clients draw from, comma-separated, repeats weighing more (default: every kind, runs "
        "three times as often): one kind alone tells which one a memory growth comes with",
    )
    args = parser.parse_args()
    if unknown := set(args.actions) - set(ACTIONS):
        parser.error(f"unknown actions {sorted(unknown)}: pick from {', '.join(ACTIONS)}")
    work = Path(tempfile.mkdtemp(prefix="mtad-soak-"))
    counter = Counter_(fake_powercap(work / "powercap"))
    stop_ticking = threading.Event()
    threading.Thread(target=counter.tick, args=(stop_ticking,), daemon=True).start()
    port = free_port()
    log_path = args.log or work / "server.log"
    env = {**os.environ, "MTAD_PAIR": "embedded", "MTAD_POWERCAP_ROOT": str(work / "powercap")}
    env["MTAD_MAX_SESSIONS"] = str(args.sessions)
    env |= {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    with log_path.open("w") as log:
        server = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        from gradio_client import Client

        for _ in range(600):
            try:
                first = Client(url, verbose=False)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if server.poll() is not None:
                    print(f"the server exited ({server.returncode}); its log: {log_path}", file=sys.stderr)
                    return 1
                time.sleep(1)
        else:
            print("the server did not come up in 10 minutes", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        first.predict(*run_args("abc def", args.max_new_tokens), api_name="/run")  # the pair loads (and compiles)
        print(f"server up; first run (loading the pair) took {time.perf_counter() - t0:.0f} s", flush=True)
        rss_start = rss_mib(server.pid)
        soak = Soak(url, args, counter)
        deadline = time.monotonic() + 60 * args.minutes
        threads = [threading.Thread(target=soak.client, args=(i, deadline), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        rss = [rss_start]
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline + args.stranded_after + 60:
            time.sleep(1)
            if len(rss) <= (time.monotonic() - deadline + 60 * args.minutes) // 60:  # one sample a minute
                rss.append(rss_mib(server.pid))
        stranded_threads = sum(t.is_alive() for t in threads)
        after = Client(url, verbose=False).predict(*run_args("abc def", args.max_new_tokens), api_name="/run")
        next_served = all(lane["state"] == "done" for lane in after[-1]["lanes"].values())
        rss_end = rss_mib(server.pid)
    finally:
        stop_ticking.set()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    tracebacks = log_path.read_text(errors="replace").count("Traceback (most recent call last)")
    stranded = soak.tally["stranded"] + stranded_threads
    print(
        f"clients {args.clients}, minutes {args.minutes:g}, max new tokens {args.max_new_tokens}, sessions kept {args.sessions}"
    )
    for outcome in OUTCOMES:
        print(f"{outcome}: {soak.tally[outcome] + (stranded_threads if outcome == 'stranded' else 0)}")
    for (action, outcome), n in sorted(soak.by_action.items()):
        print(f"  {action:9s} {outcome}: {n}")
    for (outcome, action), text in sorted(soak.examples.items()):
        print(f"  e.g. {action} {outcome}: {text}")
    print(f"a run after the soak served: {next_served}")
    print(f"tracebacks in the server log: {tracebacks} ({log_path})")
    print(f"server RSS: {rss_start:.0f} MiB after the first run, {rss_end:.0f} MiB at the end")
    print(f"server RSS each minute, MiB: {' '.join(f'{m:.0f}' for m in rss)}")
    slope = growth_per_minute(rss)
    growing = slope is not None and slope > args.max_growth
    if slope is not None:
        verdict = f"GROWING (more than {args.max_growth:g})" if growing else "flat"
        print(f"server RSS over the second half: {slope:+.1f} MiB a minute, {verdict}")
    bad = stranded or tracebacks or soak.tally["refused without a message"] or not next_served or growing
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
