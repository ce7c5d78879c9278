#!/usr/bin/env python3
"""Load-test askgui-serve's `POST /v1/agent/step` on loopback and watch its memory and queue.

What: starts the server itself (a subprocess on a free loopback port, waits for `GET /health`, stops it
at the end), then runs N concurrent clients for D seconds. Each client loops: POST a step request with
one of a few pre-encoded PNG screenshots (generated here with PIL; requests reuse them, so the server's
image cache is exercised too) and one of a few tasks; on 429 it waits `Retry-After` and retries. Every
second a sampler reads the server's RSS (`VmRSS` in /proc/PID/status) and `askgui_queue_depth` from
`GET /metrics`.

Why: to check that the server holds up under more clients than it can serve at once: every answer is a
200 or a 429, nothing else; memory stays bounded; the queue limit is enforced.

Output: one JSON line on stdout (counts, latency percentiles, throughput, RSS and queue-depth series,
the server's own timing averages); a short human summary and progress on stderr. Exits non-zero when
any answer was neither 200 nor 429 (including connection errors and timeouts) or the server died.

Bounds: no new request starts after the deadline; requests in flight at the deadline finish (or hit the
per-request timeout); a 429 whose retry would land past the deadline is abandoned; at most
--max-requests attempts in all.

    python scripts/bench/load_test_serve.py [--clients 64] [--duration 30] [--max-tokens 32] \
        [--max-queue N] [--binary target/release/askgui-serve] \
        [--model model/tests/fixtures/tiny-qwen2_5_vl] [--port PORT] \
        [--timeout 120] [--max-requests 100000] [--screenshots 4] [--screenshot-size 320x240]

More distinct screenshots than the server's image cache holds (e.g. --screenshots 200) make every
request run the image preprocessing and the vision tower, and show whether that cache keeps memory
bounded.

Needs Pillow; everything else is the standard library. Paths default to ones relative to the repository
root (found from this file's location). `bench_serve.py` reuses the server and HTTP helpers below.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = REPO_ROOT / "target" / "release" / "askgui-serve"
DEFAULT_MODEL = REPO_ROOT / "model" / "tests" / "fixtures" / "tiny-qwen2_5_vl"
STEP_PATH = "/v1/agent/step"

TASKS = [
    "Open the settings and turn on dark mode",
    "Buy oat milk",
    "Search for flights from Paris to Berlin next Friday",
    "Reply to the last message from Anna",
    "Delete the draft email",
]


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# screenshots


def make_screenshot(width: int, height: int, seed: int) -> bytes:
    """A synthetic 'screen' as PNG bytes: a background, a top bar and a few buttons and blobs."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    color = lambda: (rng.randrange(256), rng.randrange(256), rng.randrange(256))  # noqa: E731
    img = Image.new("RGB", (width, height), color())
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, width, height // 10], fill=color())
    for _ in range(6):
        x0, y0 = rng.randrange(width - 20), rng.randrange(height // 10, height - 20)
        x1, y1 = min(width - 1, x0 + rng.randrange(20, width // 2)), min(height - 1, y0 + rng.randrange(10, height // 4))
        if rng.random() < 0.5:
            d.rectangle([x0, y0, x1, y1], fill=color(), outline=color())
        else:
            d.ellipse([x0, y0, x1, y1], fill=color())
        d.text((x0 + 3, y0 + 2), f"button {rng.randrange(100)}", fill=color())
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def step_body(task: str, screenshot_b64: str, max_tokens: int) -> bytes:
    req = {"task": task, "observation": {"screenshot": screenshot_b64}, "options": {"max_tokens": max_tokens}}
    return json.dumps(req).encode()


# --------------------------------------------------------------------------------------------
# HTTP (urllib; one connection per request)


@dataclass
class Reply:
    status: int | None  # None: no HTTP answer (connection error, timeout)
    body: bytes = b""
    retry_after: float | None = None
    error: str | None = None


def http(url: str, body: bytes | None = None, timeout: float = 10.0) -> Reply:
    """GET (body None) or POST JSON; never raises for HTTP statuses or connection errors."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, r.read())
    except urllib.error.HTTPError as e:
        ra = e.headers.get("Retry-After")
        try:
            retry_after = float(ra) if ra is not None else None
        except ValueError:
            retry_after = None
        return Reply(e.code, e.read(), retry_after)
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timeout
        return Reply(None, error=f"{type(e).__name__}: {e}")


def metric_value(metrics_text: str, name: str) -> float | None:
    """The value of an unlabelled Prometheus sample `name VALUE`."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def metric_samples(metrics_text: str, prefix: str) -> dict[str, float]:
    """Every sample whose name (with labels) starts with prefix, as {name{labels}: value}."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


# --------------------------------------------------------------------------------------------
# the server process


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """askgui-serve as a subprocess on 127.0.0.1; stderr goes to a temporary log file."""

    def __init__(self, binary: Path, model: Path, port: int | None = None, extra: list[str] | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile(prefix="askgui-serve-", suffix=".log", delete=False)
        cmd = [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), *(extra or [])]
        log(f"starting: {' '.join(cmd)} (log: {self.log_file.name})")
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Polls /health until 200; returns the seconds it took. Raises if the server exits or times out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while loading:\n{self.log_tail()}")
            if http(self.url + "/health", timeout=2).status == 200:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mib(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        except OSError:
            pass
        return None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_file.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM (the server drains in-flight requests), SIGKILL if it has not exited after 40 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# --------------------------------------------------------------------------------------------
# statistics


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in 0..100."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def latency_summary(seconds: list[float]) -> dict:
    ms = [x * 1e3 for x in seconds]
    r = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {
        "n": len(ms),
        "p50_ms": r(percentile(ms, 50)),
        "p95_ms": r(percentile(ms, 95)),
        "p99_ms": r(percentile(ms, 99)),
        "max_ms": r(max(ms) if ms else None),
        "mean_ms": r(sum(ms) / len(ms) if ms else None),
    }


def mean_of(dicts: list[dict], keys: list[str]) -> dict:
    return {k: round(sum(d.get(k, 0.0) for d in dicts) / len(dicts), 2) if dicts else None for k in keys}


# --------------------------------------------------------------------------------------------
# the load


@dataclass
class Tally:
    """What the clients saw; every mutation under the lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: int = 0
    ok: int = 0
    rate_limited: int = 0  # 429 answers (each retried unless past the deadline)
    abandoned_429: int = 0  # steps given up because the retry would land past the deadline
    other_status: dict = field(default_factory=dict)  # status -> count
    conn_errors: dict = field(default_factory=dict)  # message -> count
    attempt_latency: list = field(default_factory=list)  # seconds, of the attempts answered 200
    e2e_latency: list = field(default_factory=list)  # seconds, first attempt to the 200, 429 waits included
    timings: list = field(default_factory=list)  # the answers' `timings`
    usage: list = field(default_factory=list)  # the answers' `usage`
    in_flight: int = 0
    last_done: float = 0.0

    def take_attempt(self, cap: int) -> bool:
        with self.lock:
            if self.attempts >= cap:
                return False
            self.attempts += 1
            self.in_flight += 1
            return True


def client(i: int, url: str, bodies: list[bytes], deadline: float, timeout: float, max_requests: int, t: Tally):
    rng = random.Random(i)
    while time.monotonic() < deadline:
        body = rng.choice(bodies)
        first = time.monotonic()
        while True:
            if not t.take_attempt(max_requests):
                return
            t0 = time.monotonic()
            rep = http(url, body, timeout)
            now = time.monotonic()
            with t.lock:
                t.in_flight -= 1
                t.last_done = now
                if rep.status == 200:
                    t.ok += 1
                    t.attempt_latency.append(now - t0)
                    t.e2e_latency.append(now - first)
                    ans = json.loads(rep.body)
                    t.timings.append(ans.get("timings", {}))
                    t.usage.append(ans.get("usage", {}))
                elif rep.status == 429:
                    t.rate_limited += 1
                elif rep.status is None:
                    t.conn_errors[rep.error] = t.conn_errors.get(rep.error, 0) + 1
                else:
                    key = str(rep.status)
                    t.other_status[key] = t.other_status.get(key, 0) + 1
                    if t.other_status[key] == 1:
                        log(f"client {i}: HTTP {rep.status}: {rep.body[:300]!r}")
            if rep.status != 429:
                break
            wait = rep.retry_after if rep.retry_after is not None else 1.0
            if time.monotonic() + wait >= deadline:  # the retry would start after the deadline: done
                with t.lock:
                    t.abandoned_429 += 1
                return
            time.sleep(wait)


def sampler(server: Server, t0: float, stop: threading.Event, tally: Tally, rss: list, queue: list):
    """Every second: (t, RSS MiB) and (t, queue depth, client requests in flight)."""
    while not stop.is_set():
        now = round(time.monotonic() - t0, 1)
        rss.append([now, None if (m := server.rss_mib()) is None else round(m, 1)])
        rep = http(server.url + "/metrics", timeout=2)
        depth = metric_value(rep.body.decode(), "askgui_queue_depth") if rep.status == 200 else None
        queue.append([now, depth, tally.in_flight])
        stop.wait(1.0)


def run_load(server: Server, args) -> dict:
    w, h = (int(v) for v in args.screenshot_size.lower().split("x"))
    pngs = [make_screenshot(w, h, seed) for seed in range(args.screenshots)]
    n_bodies = max(8, len(pngs))
    bodies = [step_body(TASKS[k % len(TASKS)], b64(pngs[k % len(pngs)]), args.max_tokens) for k in range(n_bodies)]
    tally, rss, queue = Tally(), [], []
    stop = threading.Event()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    sam = threading.Thread(target=sampler, args=(server, t0, stop, tally, rss, queue), daemon=True)
    sam.start()
    url = server.url + STEP_PATH
    with ThreadPoolExecutor(max_workers=args.clients) as pool:
        futures = [
            pool.submit(client, i, url, bodies, deadline, args.timeout, args.max_requests, tally)
            for i in range(args.clients)
        ]
        for f in futures:
            f.result()
    t_end = time.monotonic()
    time.sleep(1.0)  # one more sample after the load
    stop.set()
    sam.join()
    rss_values = [m for _, m in rss if m is not None]
    busy_s = (tally.last_done or t_end) - t0
    return {
        "clients": args.clients,
        "duration_s": args.duration,
        "wall_s": round(t_end - t0, 2),
        "drain_s": round(t_end - deadline, 2),
        "max_tokens": args.max_tokens,
        "screenshots": f"{len(pngs)} distinct {w}x{h} PNGs in {n_bodies} (task, screenshot) bodies, reused",
        "attempts": tally.attempts,
        "completed_steps": tally.ok,
        "status_200": tally.ok,
        "status_429": tally.rate_limited,
        "abandoned_429_at_deadline": tally.abandoned_429,
        "other_status": tally.other_status,
        "connection_errors": tally.conn_errors,
        "latency_attempt_200": latency_summary(tally.attempt_latency),
        "latency_end_to_end": latency_summary(tally.e2e_latency),
        "throughput_steps_per_s": round(tally.ok / busy_s, 3) if busy_s > 0 else None,
        "rss_mib": {
            "start": rss_values[0] if rss_values else None,
            "peak": max(rss_values) if rss_values else None,
            "end": rss_values[-1] if rss_values else None,
        },
        "rss_series": rss,
        "queue_depth_series": queue,
        "queue_depth_max": max((d for _, d, _ in queue if d is not None), default=None),
        "server_timings_mean_ms": mean_of(tally.timings, ["queue_ms", "preprocess_ms", "prefill_ms", "decode_ms"]),
        "server_usage_mean": mean_of(tally.usage, ["prompt_tokens", "image_tokens", "completion_tokens"]),
    }


def server_counters(server: Server) -> dict:
    """The server's own view at the end: step statuses, batch sizes, cancelled jobs."""
    rep = http(server.url + "/metrics", timeout=5)
    if rep.status != 200:
        return {}
    text = rep.body.decode()
    steps = {k: v for k, v in metric_samples(text, "askgui_requests_total").items() if STEP_PATH in k}
    bs_sum = metric_value(text, "askgui_batch_size_sum")
    bs_count = metric_value(text, "askgui_batch_size_count")
    return {
        "step_requests_by_status": {k.split('status="')[1].rstrip('"}'): int(v) for k, v in steps.items()},
        "batches": int(bs_count or 0),
        "mean_batch_size": round(bs_sum / bs_count, 2) if bs_count else None,
        "jobs_cancelled": metric_value(text, "askgui_jobs_cancelled_total"),
    }


def summary(r: dict) -> str:
    a, e = r["latency_attempt_200"], r["latency_end_to_end"]
    rss = r["rss_mib"]
    st = r["server_timings_mean_ms"]
    return "\n".join(
        [
            f"{r['clients']} clients, {r['duration_s']} s (+{r['drain_s']} s draining): "
            f"{r['completed_steps']} steps OK, {r['status_429']} x 429 ({r['abandoned_429_at_deadline']} abandoned "
            f"at the deadline), other statuses {r['other_status'] or 'none'}, "
            f"connection errors {r['connection_errors'] or 'none'}",
            f"latency of 200 attempts p50/p95/p99/max: {a['p50_ms']}/{a['p95_ms']}/{a['p99_ms']}/{a['max_ms']} ms; "
            f"end to end with 429 retries: {e['p50_ms']}/{e['p95_ms']}/{e['p99_ms']}/{e['max_ms']} ms",
            f"throughput {r['throughput_steps_per_s']} steps/s; queue depth max {r['queue_depth_max']}; "
            f"server RSS start/peak/end {rss['start']}/{rss['peak']}/{rss['end']} MiB",
            f"server timings (mean ms): queue {st['queue_ms']}, preprocess {st['preprocess_ms']}, "
            f"prefill {st['prefill_ms']}, decode {st['decode_ms']}; server alive at the end: {r['server_alive']}",
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds during which new requests start")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=None, help="the server's --max-queue (its default if unset)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="the server's --device (bf16 on cuda)")
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    ap.add_argument("--max-requests", type=int, default=100_000, help="cap on attempts in all")
    ap.add_argument("--screenshots", type=int, default=4, help="distinct screenshots the clients pick from")
    ap.add_argument("--screenshot-size", default="320x240", help="WIDTHxHEIGHT")
    args = ap.parse_args()

    extra = ["--max-queue", str(args.max_queue)] if args.max_queue is not None else []
    if args.device is not None:
        extra += ["--device", args.device] + (["--dtype", "bf16"] if args.device == "cuda" else [])
    t_start = time.monotonic()
    server = Server(args.binary, args.model, args.port, extra)
    try:
        load_s = server.wait_ready()
        log(f"server ready in {load_s:.2f} s (pid {server.pid}); {args.clients} clients for {args.duration} s")
        result = {"server_load_s": round(load_s, 2), "max_queue": args.max_queue, **run_load(server, args)}
        result["server_alive"] = server.alive()
        result["server_counters"] = server_counters(server) if result["server_alive"] else {}
    finally:
        code = server.stop()
    result["server_exit_code"] = code
    result["total_run_s"] = round(time.monotonic() - t_start, 2)
    print(json.dumps(result), flush=True)
    log(summary(result))
    failed = bool(result["other_status"] or result["connection_errors"]) or not result["server_alive"]
    if failed:
        log(f"FAILED; server log tail:\n{server.log_tail()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
