"""A soak of the whole server: concurrent asks in every mode while the cache is evicted and
cleared underneath, with the process's RSS sampled throughout.

Used by tests/app/test_soak.py (tiny model, bounded) and by hand for the real model:

    python -m tests.app.soak --seconds 100 --clients 3          # SmolLM2: docs/benchmarks/memory.md
    python -m tests.app.soak --seconds 100 --malloc-arenas 0 --trim-interval 0   # glibc defaults

Every `full` answer must equal the one computed before the load (greedy decoding, same
prompt); every request must succeed (a 503 from a full queue counts as an error: the soak's
clients never exceed the queue).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil

MODES = ("full", "cacheblend", "cachecraft", "naive", "epic", "prefix")


@dataclass
class SoakResult:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    full_mismatches: list[str] = field(default_factory=list)
    admin_actions: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)

    def rss_mib(self, start: float, end: float) -> list[float]:
        """RSS samples (MiB) taken between `start` and `end`, as fractions of the run."""
        last = self.rss_samples[-1][0] if self.rss_samples else 0.0
        return [rss / 2**20 for t, rss in self.rss_samples if start * last <= t <= end * last]

    def summary(self) -> dict:
        thirds = [self.rss_mib(a, b) for a, b in ((0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1))]
        return {
            "requests": self.requests,
            "errors": len(self.errors),
            "full_mismatches": len(self.full_mismatches),
            "admin_actions": self.admin_actions,
            "rss_mib_first": round(self.rss_samples[0][1] / 2**20, 1) if self.rss_samples else None,
            "rss_mib_max_per_third": [round(max(t), 1) if t else None for t in thirds],
            "rss_mib_median_per_third": [
                round(statistics.median(t), 1) if t else None for t in thirds
            ],
            "rss_mib_last": round(self.rss_samples[-1][1] / 2**20, 1) if self.rss_samples else None,
        }


def reference_answers(base_url: str, questions: list[str], max_tokens: int) -> dict[str, str]:
    with httpx.Client(base_url=base_url, timeout=300) as client:
        return {q: _ask(client, q, "full", max_tokens, False)["answer"] for q in questions}


def run_soak(
    base_url: str,
    questions: list[str],
    reference: dict[str, str],
    seconds: float,
    clients: int = 3,
    max_tokens: int = 8,
    admin_token: str | None = None,
    admin_every_s: float = 2.0,
    rss_every_s: float = 1.0,
    seed: int = 0,
) -> SoakResult:
    """Drive the server for `seconds`; returns what happened (see the module docstring)."""
    result, lock = SoakResult(), threading.Lock()
    stop = threading.Event()
    started = time.monotonic()
    workers = [
        threading.Thread(
            target=_client_loop,
            args=(base_url, questions, reference, max_tokens, seed + i, stop, result, lock),
            daemon=True,
        )
        for i in range(clients)
    ]
    workers.append(
        threading.Thread(target=_sample_rss, args=(started, rss_every_s, stop, result), daemon=True)
    )
    if admin_token:
        workers.append(
            threading.Thread(
                target=_admin_loop,
                args=(base_url, admin_token, admin_every_s, stop, result, lock),
                daemon=True,
            )
        )
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join(timeout=300)
    return result


def _ask(client: httpx.Client, question: str, mode: str, max_tokens: int, stream: bool) -> dict:
    body = {"question": question, "mode": mode, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        response = client.post("/ask", json=body)
        response.raise_for_status()
        return response.json()
    with client.stream("POST", "/ask", json=body) as response:
        response.raise_for_status()
        frames = [line for line in response.iter_lines() if line.startswith("data:")]
    event = json.loads(frames[-1][5:])
    if "error" in event:
        raise RuntimeError(f"stream ended with an error event: {event['error']}")
    return event


def _client_loop(base_url, questions, reference, max_tokens, seed, stop, result, lock) -> None:
    rng = random.Random(seed)
    plan = itertools.cycle(MODES)
    with httpx.Client(base_url=base_url, timeout=300) as client:  # one keep-alive connection
        while not stop.is_set():
            question, mode, stream = rng.choice(questions), next(plan), rng.random() < 0.3
            try:
                answer = _ask(client, question, mode, max_tokens, stream)
            except Exception as exc:  # every failure is a finding, whatever its kind
                with lock:
                    result.requests += 1
                    result.errors.append(f"{mode} {question!r}: {exc!r}")
                continue
            with lock:
                result.requests += 1
                if mode == "full" and answer["answer"] != reference[question]:
                    result.full_mismatches.append(
                        f"{question!r}: {answer['answer']!r} != {reference[question]!r}"
                    )


def _admin_loop(base_url, token, every_s, stop, result, lock) -> None:
    """Evict the cpu tier, evict by policy, evict one chunk, clear everything: in turn."""
    headers = {"Authorization": f"Bearer {token}"}
    actions = itertools.cycle(
        [
            ("POST", "/admin/evict", {"tier": "cpu"}),
            ("POST", "/admin/evict", {"tier": "cpu", "bytes": 1, "policy": "lfu"}),
            ("POST", "/admin/evict", {"chunk_id": 1}),
            ("DELETE", "/admin/cache", None),
        ]
    )
    with httpx.Client(base_url=base_url, timeout=300, headers=headers) as client:
        while not stop.wait(every_s):
            method, path, body = next(actions)
            response = client.request(method, path, json=body)
            with lock:
                result.admin_actions += 1
                if response.status_code != 200:
                    result.errors.append(
                        f"{method} {path}: {response.status_code} {response.text[:200]}"
                    )


def _sample_rss(started: float, every_s: float, stop: threading.Event, result: SoakResult) -> None:
    process = psutil.Process()
    while True:
        result.rss_samples.append((time.monotonic() - started, process.memory_info().rss))
        if stop.wait(every_s):
            return


# -- by hand: the real model ---------------------------------------------------------------------

QUESTIONS = [
    "When was the Hollin Point Lighthouse first lit?",
    "Who built the Long Arm?",
    "What does the Port Ellery harbour master do in winter?",
    "When was the tide mill built?",
    "How long does the ferry take to Skarra?",
    "What is the Port Ellery festival called?",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=100)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--malloc-arenas", type=int, default=None, help="default: the setting's")
    parser.add_argument("--trim-interval", type=float, default=None, help="default: the setting's")
    args = parser.parse_args()
    print(json.dumps(soak_real_model(args), indent=1))


def soak_real_model(args) -> dict:
    """Serve the data dir's catalog with the embedded model on a free port and soak it."""
    import uvicorn

    from app.main import create_app
    from app.services import Services
    from app.settings import Settings
    from tests.app.conftest import free_port

    overrides = {"data_dir": args.data_dir, "admin_token": "soak", "workers": 2, "queue_size": 16}
    if args.malloc_arenas is not None:
        overrides["malloc_arenas"] = args.malloc_arenas
    if args.trim_interval is not None:
        overrides["trim_interval_s"] = args.trim_interval
    services = Services.start(Settings(**overrides))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(services=services), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    try:
        reference = reference_answers(url, QUESTIONS, args.max_tokens)
        result = run_soak(
            url, QUESTIONS, reference, args.seconds, args.clients, args.max_tokens, "soak"
        )
        idle_rss = _rss_after_idle(url, services)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        services.close()
    return {
        **result.summary(),
        **idle_rss,
        "errors_sample": result.errors[:3],
        "settings": {
            "malloc_arenas": services.settings.malloc_arenas,
            "trim_interval_s": services.settings.trim_interval_s,
        },
    }


def _rss_after_idle(url: str, services) -> dict:
    """RSS after 20 s idle, then after a cache clear (the issue's two figures)."""
    time.sleep(20)
    idle = psutil.Process().memory_info().rss / 2**20
    httpx.delete(url + "/admin/cache", headers={"Authorization": "Bearer soak"}, timeout=60)
    time.sleep(2)
    cleared = psutil.Process().memory_info().rss / 2**20
    return {"rss_mib_after_20s_idle": round(idle, 1), "rss_mib_after_clear": round(cleared, 1)}


if __name__ == "__main__":
    main()
