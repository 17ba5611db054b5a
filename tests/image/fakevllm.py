#!/usr/bin/env python3
"""fakevllm: a stdlib-only stand-in for a vLLM OpenAI server, for sparkd's tests.

It runs as PID 1 of the test image (exec-form ENTRYPOINT), takes vLLM-style
arguments (``[serve MODEL] --port 8000 --gpu-memory-utilization 0.786
--max-model-len N --shutdown-timeout 25``; unknown ones are ignored) and
behaves like vLLM where sparkd looks:

* prints vLLM's start-up lines (``startup.log`` next to this file), spread over
  the start-up delay; ``GET /health`` answers 503 until ready, then 200;
* ``GET /metrics``: Prometheus text as vLLM writes it (prometheus_client
  format: counters have ``_total`` and ``_created`` samples);
* ``GET /v1/models``, ``POST /v1/completions`` (a few fake tokens; hangs while
  progress is stalled, as a stuck engine does; 401 without the API key when
  ``--api-key``/``VLLM_API_KEY`` is set).

Test controls (POST, query parameters, JSON answers):

* ``/requests?running=N&waiting=M`` set the request gauges; while not stalled,
  ``generation_tokens_total`` grows with running and ``prompt_tokens_total``
  with waiting (``FAKEVLLM_TOKENS_PER_S`` per request, default 50);
* ``/stall?on=1|0`` stop/resume token progress (``/health`` keeps answering);
* ``/serve?mode=normal|empty|hang|unhealthy`` switch the serving mode (below) at run time;
* ``/alloc?mib=N`` allocate N MiB, write every page, hold it; ``/free`` release;
* ``/shm?n=K[&kib=S]`` create K /dev/shm entries with the names vLLM, NCCL and
  loky use, held open and mapped while running; answers ``{"names": [...]}``;
* ``GET /state``: pid, mode, ready, counts, allocations, shm names.

Behaviour (flag, else environment, else default):

* ``--fake-mode`` / ``FAKEVLLM_MODE``: ``graceful`` (default; SIGTERM/SIGINT →
  exit 0 after ``FAKEVLLM_EXIT_DELAY_S``, default 0.2), ``ignore-term``
  (logs and ignores SIGTERM; only SIGKILL ends it), ``crash`` (exits 1 after
  ``FAKEVLLM_CRASH_AFTER_S``, default 3), ``never-ready`` (/health never 200);
* ``FAKEVLLM_STARTUP_S`` (default 1.0): seconds until ready;
* ``--fake-serve`` / ``FAKEVLLM_SERVE``: how a ready server answers — ``normal`` (default), ``empty``
  (``/health`` 200 but completions with no tokens, a known vLLM failure), ``hang`` (``/health`` 200,
  completions never answer), ``unhealthy`` (``/health`` 500, completions 500);
* ``FAKEVLLM_SERVE_AFTER_S`` (default 0): serve ``normal`` for this long after ready, then switch to
  ``FAKEVLLM_SERVE`` (a server that breaks after it became ready, every launch);
* ``FAKEVLLM_DECODE_TOK_S`` (default 0 = at once): a completion of N tokens takes N / this seconds;
* a completion body may carry ``"fake_hold_s": S``: the request stays in flight S seconds, counted in
  ``vllm:num_requests_running`` meanwhile (a real in-flight request for drain tests);
* ``FAKEVLLM_SHM_CLEANUP=1``: unlink the /dev/shm entries on graceful exit.
* ``FAKEVLLM_NEVER_READY_WHEN=--max-num-seqs=7``: never ready when launched with that
  argument value (a bad configuration, for rollback tests).
  Default: leave them behind, as a runtime that dies without cleanup does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import re
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

HERE = Path(__file__).resolve().parent
MODES = ("graceful", "ignore-term", "crash", "never-ready")
SERVE_MODES = ("normal", "empty", "hang", "unhealthy")
PAGE = mmap.PAGESIZE
SHM_DIR = Path("/dev/shm")


def log(level: str, where: str, msg: str) -> None:
    """One line in vLLM's format: ``INFO 10-03 16:20:02 [file.py:N] message``."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"{level} {stamp} [{where}] {msg}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="fakevllm", add_help=True)
    p.add_argument("positional", nargs="*", help="optional: serve MODEL")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--shutdown-timeout", type=float, default=None)
    p.add_argument("--api-key", default=env("VLLM_API_KEY"))
    p.add_argument("--fake-mode", choices=MODES, default=env("FAKEVLLM_MODE", "graceful"))
    p.add_argument("--fake-serve", choices=SERVE_MODES, default=env("FAKEVLLM_SERVE", "normal"))
    p.add_argument("--fake-serve-after-s", type=float, default=float(env("FAKEVLLM_SERVE_AFTER_S", "0")))
    p.add_argument("--fake-decode-tok-s", type=float, default=float(env("FAKEVLLM_DECODE_TOK_S", "0")))
    p.add_argument("--fake-startup-s", type=float, default=float(env("FAKEVLLM_STARTUP_S", "1.0")))
    p.add_argument("--fake-exit-delay-s", type=float, default=float(env("FAKEVLLM_EXIT_DELAY_S", "0.2")))
    p.add_argument("--fake-crash-after-s", type=float, default=float(env("FAKEVLLM_CRASH_AFTER_S", "3")))
    p.add_argument(
        "--fake-shm-cleanup",
        action="store_true",
        default=env("FAKEVLLM_SHM_CLEANUP", "0").lower() in ("1", "true", "yes"),
    )
    p.add_argument("--fake-tokens-per-s", type=float, default=float(env("FAKEVLLM_TOKENS_PER_S", "50")))
    p.add_argument("--max-num-seqs", type=int, default=None)
    # a configuration that never becomes ready, as a real bad launch (e.g. "--max-num-seqs=7"): tests of rollback
    p.add_argument("--fake-never-ready-when", default=env("FAKEVLLM_NEVER_READY_WHEN", ""))
    args, unknown = p.parse_known_args(argv)
    if args.fake_never_ready_when:
        flag, _, value = args.fake_never_ready_when.partition("=")
        if str(getattr(args, flag.lstrip("-").replace("-", "_"), None)) == value:
            args.fake_mode = "never-ready"
    pos = list(args.positional)
    if pos and pos[0] == "serve":
        pos = pos[1:]
    args.model = args.model or (pos[0] if pos else "/models/fake")
    args.served_model_name = args.served_model_name or args.model
    args.unknown = unknown
    return args


class Engine:
    """The fake engine's state; every field is guarded by ``lock``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.ready = False
        self.stalled = False
        self.serve = "normal" if args.fake_serve_after_s > 0 else args.fake_serve
        self.held = 0  # completions in flight with fake_hold_s
        self.running = 0
        self.waiting = 0
        self.completions = 0
        self.generation_tokens = 0.0
        self.prompt_tokens = 0.0
        self.created = time.time()
        self.blocks: list[bytearray] = []
        self.shm: dict[str, tuple[int, mmap.mmap | None]] = {}

    # -- memory ---------------------------------------------------------
    def alloc(self, mib: int) -> int:
        buf = bytearray(mib * 1024 * 1024)
        buf[::PAGE] = b"\x01" * len(range(0, len(buf), PAGE))  # touch every page
        with self.lock:
            self.blocks.append(buf)
            return self.allocated_mib()

    def free(self) -> int:
        with self.lock:
            self.blocks.clear()
            return 0

    def allocated_mib(self) -> int:
        return sum(len(b) for b in self.blocks) // (1024 * 1024)

    # -- /dev/shm -------------------------------------------------------
    def make_shm(self, n: int, kib: int) -> list[str]:
        names = []
        for i in range(n):
            kind = i % 5
            tag = uuid.uuid4().hex
            if kind == 0:
                name, size = f"psm_{tag[:8]}", kib * 1024
            elif kind == 1:
                name, size = f"nccl-{tag[:6]}", 0  # NCCL's are often empty
            elif kind == 2:
                name, size = f"sem.loky-{os.getpid()}-{tag[:8]}", 32  # a POSIX semaphore
            elif kind == 3:
                name, size = f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{tag}", kib * 1024
            else:
                name, size = f"vllm_offload_{uuid.uuid4()}.mmap", kib * 1024
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            mm = None
            if size:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
                mm[::PAGE] = b"\x01" * len(range(0, size, PAGE))  # tmpfs pages really used
            with self.lock:
                self.shm[name] = (fd, mm)
            names.append(name)
        return names

    def cleanup_shm(self) -> list[str]:
        with self.lock:
            entries, self.shm = self.shm, {}
        for name, (fd, mm) in entries.items():
            if mm is not None:
                mm.close()
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / name)
        return sorted(entries)

    # -- progress -------------------------------------------------------
    def tick(self, dt_s: float) -> None:
        with self.lock:
            if self.ready and not self.stalled:
                rate = self.args.fake_tokens_per_s * dt_s
                self.generation_tokens += (self.running + self.held) * rate
                self.prompt_tokens += self.waiting * rate

    def metrics(self) -> str:
        labels = f'{{engine="0",model_name="{self.args.served_model_name}"}}'
        with self.lock:
            gauges = [
                (
                    "vllm:num_requests_running",
                    "Number of requests in model execution batches.",
                    self.running + self.held,
                ),
                (
                    "vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.",
                    self.waiting,
                ),
                (
                    "vllm:kv_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage.",
                    min(1.0, 0.05 * (self.running + self.waiting)),
                ),
            ]
            counters = [
                ("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
                (
                    "vllm:generation_tokens",
                    "Number of generation tokens processed.",
                    self.generation_tokens,
                ),
            ]
        out = []
        for name, help_, value in gauges:
            out += [
                f"# HELP {name} {help_}",
                f"# TYPE {name} gauge",
                f"{name}{labels} {float(value)!r}",
            ]
        for name, help_, value in counters:
            # prometheus_client's text format: the _created sample rides in the family.
            out += [
                f"# HELP {name}_total {help_}",
                f"# TYPE {name}_total counter",
                f"{name}_total{labels} {float(int(value))!r}",  # whole tokens
                f"{name}_created{labels} {self.created!r}",
            ]
        return "\n".join(out) + "\n"

    def state(self) -> dict[str, object]:
        with self.lock:
            return {
                "pid": os.getpid(),
                "mode": self.args.fake_mode,
                "ready": self.ready,
                "stalled": self.stalled,
                "serve": self.serve,
                "held": self.held,
                "completions": self.completions,
                "running": self.running,
                "waiting": self.waiting,
                "generation_tokens_total": self.generation_tokens,
                "prompt_tokens_total": self.prompt_tokens,
                "allocated_mib": self.allocated_mib(),
                "shm": sorted(self.shm),
                "argv": sys.argv,
                "unknown_args": self.args.unknown,
            }


class Handler(BaseHTTPRequestHandler):
    engine: Engine  # set on the subclass in main()
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # /health and /metrics polls would drown the start-up lines

    def reply(self, code: int, body: object, ctype: str = "application/json") -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def query(self) -> dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(urlparse(self.path).query).items()}

    def authorized(self) -> bool:
        key = self.engine.args.api_key
        if not key or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self.reply(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:
        path, eng = urlparse(self.path).path, self.engine
        if path == "/health":
            if eng.ready and eng.serve == "unhealthy":
                self.reply(500, "engine dead (fake serve mode unhealthy)", "text/plain")
            else:
                self.reply(200 if eng.ready else 503, "" if eng.ready else "not ready", "text/plain")
        elif path == "/metrics":
            self.reply(200, eng.metrics(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/state":
            self.reply(200, eng.state())
        elif path == "/v1/models":
            if self.authorized():
                a = eng.args
                self.reply(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": a.served_model_name,
                                "object": "model",
                                "owned_by": "vllm",
                                "root": a.model,
                                "max_model_len": a.max_model_len,
                            }
                        ],
                    },
                )
        else:
            self.reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path, q, eng = urlparse(self.path).path, self.query(), self.engine
        try:
            if path == "/alloc":
                self.reply(200, {"allocated_mib": eng.alloc(int(q.get("mib", "0")))})
            elif path == "/free":
                self.reply(200, {"allocated_mib": eng.free()})
            elif path == "/shm":
                names = eng.make_shm(int(q.get("n", "5")), int(q.get("kib", "64")))
                self.reply(200, {"names": names})
            elif path == "/requests":
                with eng.lock:
                    eng.running = int(q.get("running", eng.running))
                    eng.waiting = int(q.get("waiting", eng.waiting))
                self.reply(200, eng.state())
            elif path == "/serve":
                mode = q.get("mode", "normal")
                if mode not in SERVE_MODES:
                    raise ValueError(f"mode: {mode!r} is not allowed; allowed: {', '.join(SERVE_MODES)}")
                with eng.lock:
                    eng.serve = mode
                self.reply(200, eng.state())
            elif path == "/stall":
                with eng.lock:
                    eng.stalled = q.get("on", "1") not in ("0", "false", "no")
                self.reply(200, eng.state())
            elif path == "/v1/completions":
                self.completions()
            else:
                self.reply(404, {"detail": "Not Found"})
        except (ValueError, OSError) as e:
            self.reply(400, {"error": type(e).__name__, "detail": str(e)})

    def completions(self) -> None:
        if not self.authorized():
            return
        eng = self.engine
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if not eng.ready:
            self.reply(503, {"error": "not ready"})
            return
        if eng.serve == "unhealthy":
            self.reply(500, {"error": "EngineDeadError (fake serve mode unhealthy)"})
            return
        deadline = time.monotonic() + 600
        while (eng.stalled or eng.serve == "hang") and time.monotonic() < deadline:  # a stuck engine never answers
            time.sleep(0.05)
        hold_s = float(body.get("fake_hold_s", 0) or 0)
        if hold_s > 0:  # a real request in flight: counted as running until it ends
            with eng.lock:
                eng.held += 1
            time.sleep(min(hold_s, 600))
            with eng.lock:
                eng.held -= 1
        n = max(1, min(int(body.get("max_tokens", 16)), 64))
        if eng.args.fake_decode_tok_s > 0:
            time.sleep(n / eng.args.fake_decode_tok_s)
        empty = eng.serve == "empty"
        prompt = str(body.get("prompt", ""))
        n_prompt = max(1, len(prompt.split()))
        with eng.lock:
            eng.completions += 1
            eng.prompt_tokens += n_prompt
            eng.generation_tokens += 0 if empty else n
        self.reply(
            200,
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": eng.args.served_model_name,
                "choices": [{"index": 0, "text": "" if empty else " fake" * n, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": 0 if empty else n,
                    "total_tokens": n_prompt + (0 if empty else n),
                },
            },
        )


def startup_lines(args: argparse.Namespace) -> list[str]:
    """The recorded vLLM start-up lines, with this server's port substituted."""
    path = HERE / "startup.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [re.sub(r"(http://0\.0\.0\.0:)\d+", rf"\g<1>{args.port}", ln) for ln in lines]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    eng = Engine(args)
    handler = type("BoundHandler", (Handler,), {"engine": eng})
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()

    term = threading.Event()

    def on_term(signum: int, _frame: object) -> None:
        if args.fake_mode == "ignore-term" and signum == signal.SIGTERM:
            log("WARNING", "fakevllm.py:1", "received SIGTERM; ignoring it (mode ignore-term)")
            return
        term.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    t0 = time.monotonic()
    lines = startup_lines(args)
    final = [ln for ln in lines if "Application startup complete" in ln]
    body = [ln for ln in lines if ln not in final]
    if args.unknown:
        log("WARNING", "fakevllm.py:1", f"ignoring unknown arguments: {args.unknown}")
    for i, ln in enumerate(body):  # spread the lines over the start-up delay
        if term.wait(max(0.0, t0 + args.fake_startup_s * i / max(1, len(body)) - time.monotonic())):
            break
        print(ln, flush=True)
    ready_in_s = max(0.0, t0 + args.fake_startup_s - time.monotonic())
    if not term.wait(ready_in_s) and args.fake_mode != "never-ready":
        with eng.lock:
            eng.ready = True
        for ln in final:
            print(ln, flush=True)

    crash_at = t0 + args.fake_crash_after_s
    serve_at = time.monotonic() + args.fake_serve_after_s if args.fake_serve_after_s > 0 else None
    last = time.monotonic()
    while not term.wait(0.1):
        now = time.monotonic()
        eng.tick(now - last)
        last = now
        if serve_at is not None and now >= serve_at:
            serve_at = None
            with eng.lock:
                eng.serve = args.fake_serve
            log("WARNING", "fakevllm.py:1", f"serve mode now {args.fake_serve}")
        if args.fake_mode == "crash" and now >= crash_at:
            log("ERROR", "core.py:708", "EngineCore encountered a fatal error (fakevllm crash)")
            sys.stdout.flush()
            os._exit(1)

    log("INFO", "launcher.py:99", "Shutting down FastAPI HTTP server.")
    time.sleep(args.fake_exit_delay_s)
    if args.fake_shm_cleanup:
        removed = eng.cleanup_shm()
        log("INFO", "fakevllm.py:1", f"removed {len(removed)} /dev/shm entries")
    server.shutdown()
    print("INFO:     Shutting down", flush=True)
    print("INFO:     Application shutdown complete.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
