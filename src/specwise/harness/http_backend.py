"""The HTTP backend: measure any OpenAI-compatible server (specwise serve, vLLM, SGLang, llama.cpp) as a client does.

Every request is streamed: TTFT is the time to the first chunk that carries text, inter-token latencies are the
gaps between such chunks, E2E ends at the last byte. Where the server reports per-request speculation statistics
(specwise's `speculative` extension) they go into the record; where it exposes vLLM's spec-decode counters on
`/metrics`, they are scraped before and after each phase and the difference is kept per phase.

Configurations differ either by a request field (`options`, e.g. specwise's `{"speculative": {"enabled": false}}`)
or by a server command (`launch`): the backend starts that configuration's server, waits for `/health`, warms it
up, measures, and stops it before starting the next. No torch here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from specwise.errors import SpecwiseError
from specwise.harness import commands
from specwise.harness.backends import WARM_UP, Phase, PhaseWork, Request, dispatch
from specwise.harness.background import listening_pid
from specwise.harness.config import Config, redact
from specwise.harness.facts import check_comparable, hardware
from specwise.harness.load import Load
from specwise.harness.server_reports import (
    counter_delta,
    own_speculative,
    parse_spec_counters,
    spec_from_payload,
)
from specwise.harness.store import Record
from specwise.identity import local_weights
from specwise.speccounts import SpecCounts

# A request's deadline (the whole stream, from the request to its last byte) unless --request-timeout sets one:
# generous for a CPU server under load, finite for one that sends keep-alives or data without end.
DEADLINE_BASE_S = 300.0
DEADLINE_PER_TOKEN_S = 2.0
MAX_LINE_BYTES = 1 << 20  # one line of a stream
MAX_RESPONSE_BYTES = 64 << 20  # one request's whole stream


@dataclass(frozen=True)
class EndpointOptions:
    """How the harness talks to an endpoint: its API key, the sampling temperature, the read timeout, how long a
    launched server may take to become healthy, each request's own deadline (None: none), and where launched servers'
    logs go."""

    api_key: str | None = None
    temperature: float = 0.0
    timeout: float = 600.0
    launch_timeout: float = 600.0
    request_timeout: float | None = None
    log_dir: Path | None = None


class HTTPBackend:
    """Runs configurations against an OpenAI-compatible endpoint, launching a server per configuration if asked."""

    def __init__(self, endpoint: str, model: str | None, configs: list[Config], options: EndpointOptions | None = None):
        o = options or EndpointOptions()
        api_key, temperature, timeout, launch_timeout = o.api_key, o.temperature, o.timeout, o.launch_timeout
        log_dir, request_timeout = o.log_dir, o.request_timeout
        if request_timeout is not None and not request_timeout > 0:
            raise SpecwiseError(f"--request-timeout {request_timeout} is not allowed: give seconds above 0")
        self.request_timeout, self.read_timeout = request_timeout, timeout
        if not re.match(r"^https?://[^/\s]+", endpoint or ""):
            raise SpecwiseError(f"--endpoint {endpoint!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        self.base = endpoint.rstrip("/").removesuffix("/v1")
        self.model, self.configs = model, {c.name: c for c in configs}
        self.user_model = model  # as given; each launched server is asked for its own when None
        self.server_facts: dict[str, dict] = {}  # configuration → what its server reported at start
        self.temperature, self.launch_timeout, self.log_dir = temperature, launch_timeout, log_dir
        launches = [c.launch for c in configs]
        if any(launches) and not all(launches):
            raise SpecwiseError("--launch: give a command for every configuration (the baseline too), or for none")
        self.launching = all(launches)
        self.whole_phases = self.launching  # each configuration switch restarts a server
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=10.0),
            headers=headers,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        self.proc: subprocess.Popen | None = None
        self.reaper: subprocess.Popen | None = None  # kills the launched server's group if this process dies
        self.current: str | None = None
        if not self.launching:
            self.model = self._discover_model()

    # --- servers ---------------------------------------------------------------------------------------------

    def _get(self, path: str) -> httpx.Response:
        return self.client.get(self.base + path, timeout=10.0)

    def _discover_model(self) -> str:
        try:
            r = self._get("/v1/models")
        except httpx.HTTPError as exc:
            raise SpecwiseError(f"cannot reach {self.base}/v1/models ({exc}); is the server running?") from None
        if r.status_code == 401:
            raise SpecwiseError(f"{self.base} refused the API key (401): pass the right one with --api-key")
        try:
            data = r.json()["data"]
        except (ValueError, KeyError, TypeError):
            raise SpecwiseError(f"{self.base}/v1/models did not answer with a model list ({r.status_code})") from None
        names = [m.get("id") for m in data]
        if self.model is None:
            if len(names) != 1:
                raise SpecwiseError(f"{self.base} serves {names}: choose one with --model")
            self.model = names[0]
        if self.model not in names:
            raise SpecwiseError(f"{self.base} does not serve --model {self.model!r} (it serves {names})")
        entry = data[names.index(self.model)]
        self.target = entry.get("specwise", {}).get("target") or {"name": self.model, "endpoint": self.base}
        return self.model

    def _check_port_free(self, name: str) -> None:
        """Refuse to launch while something already answers at the endpoint: it would be measured in place of the
        configuration (an orphan of an earlier run, another configuration's server, another program)."""
        url = httpx.URL(self.base)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.host, port), timeout=2.0):
                pass
        except OSError:
            return
        who = _listener(port)
        raise SpecwiseError(
            f"--launch for {name!r}: {url.host}:{port} already answers ({who or 'a process this user cannot see'}): "
            "stop it first, or point --endpoint at a free port — a server there would be measured in place of "
            "the one launched"
        )

    def _start(self, name: str) -> None:
        cmd = self.configs[name].launch
        assert cmd is not None  # launching: every configuration has a command (checked in __init__)
        self._check_port_free(name)
        log_path = (self.log_dir or Path(".")) / f"server-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it until stopped
        try:
            env, argv = commands.split(cmd)  # `VAR=1 prog …` as a shell reads it, with or without `env`
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env}
            )
        except (OSError, ValueError, SpecwiseError) as exc:
            raise SpecwiseError(f"--launch for {name!r}: cannot start {redact(cmd)!r} ({exc})") from None
        finally:
            log.close()
        self.reaper = _reaper(self.proc.pid)
        deadline = time.monotonic() + self.launch_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-1500:]
                self.proc = None
                raise SpecwiseError(
                    f"--launch for {name!r}: the server exited before it was healthy; its log "
                    f"({log_path}) ends:\n{tail}"
                )
            try:
                if self._get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
            raise SpecwiseError(
                f"--launch for {name!r}: {self.base}/health did not answer 200 within {self.launch_timeout:.0f} s "
                f"(--launch-timeout); the server was stopped; its log ({log_path}) ends:\n{tail}"
            )
        self.current = name
        self.model = self.user_model
        self._discover_model()
        self.server_facts[name] = self._facts_now()
        try:
            check_comparable(self.server_facts)  # before anything of this configuration is measured
        except SpecwiseError as exc:
            self.stop()
            raise SpecwiseError(f"configuration {name!r}: {exc}") from None
        self._warm(name)

    def stop(self) -> None:
        """Stop the launched server (its whole process group), politely first."""
        if self.proc is None:
            return
        if self.reaper is not None:  # this stop is the orderly one: the reaper may go
            with contextlib.suppress(OSError):
                assert self.reaper.stdin is not None
                self.reaper.stdin.write(b"ok")
                self.reaper.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reaper.wait(timeout=5)
            self.reaper = None
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.proc, self.current = None, None

    def close(self) -> None:
        self.stop()
        self.client.close()

    def _ensure(self, name: str) -> None:
        if self.launching and self.current != name:
            self.stop()
            self._start(name)

    # --- the runner's interface ---------------------------------------------------------------------------------

    def info(self) -> dict:
        target = getattr(self, "target", None) or {"name": self.model, "endpoint": self.base}
        return {
            "target": target,
            "hardware": {**hardware(), "endpoint": self.base, "measured_from": "client"},
            "configs": {n: {"launch": redact(c.launch), "options": c.options} for n, c in self.configs.items()},
            "backend": "http",
        }

    def facts(self, config: str) -> dict | None:
        """What this configuration's server reported when it started (launched), or the one shared server."""
        if self.launching:
            return self.server_facts.get(config)
        if "shared" not in self.server_facts:
            self.server_facts["shared"] = self._facts_now()
        return self.server_facts["shared"]

    def _facts_now(self) -> dict:
        """The running server's target and build, from whichever of /v1/models (specwise), /props (llama.cpp),
        /version (vLLM) and /get_server_info (SGLang) it answers; the client machine as hardware."""
        target = dict(self.target)
        server: dict = {"kind": "unknown", "version": None}
        own = self._json("/v1/models")
        models = (own or {}).get("data")
        entry: dict = next((m for m in models or [] if isinstance(m, dict) and m.get("id") == self.model), {})
        path = None  # where the server says it loaded the weights from
        if entry.get("specwise"):
            own_info = entry["specwise"]
            server = {"kind": "specwise", "version": own_info.get("version"), "kernels": own_info.get("kernels")}
        elif (props := self._json("/props")) and "build_info" in props:
            server = {"kind": "llama.cpp", "version": props.get("build_info")}
            path = props.get("model_path")
        elif (ver := self._json("/version")) and "version" in ver:
            server = {"kind": "vllm", "version": ver.get("version")}
            path = entry.get("root")
        elif (info := self._json("/get_server_info")) and "version" in info:
            server = {"kind": "sglang", "version": info.get("version")}
            path = info.get("model_path")
        if isinstance(path, str) and "sha256" not in target:
            target.setdefault("path", path)
            if not self._remote():  # a path on this machine: name its weights as the engine would
                target.update(local_weights(path))
        return {"target": target, "server": server, "hardware": {**hardware(), "measured_from": "client"}}

    def observed(self) -> tuple[list[int], bool]:
        """Launched servers are this process's descendants; an endpoint on this machine started by someone else is
        the process listening on its port (if this user can see it); any other endpoint: only the client side."""
        if self._remote():
            return [], True
        if self.launching:
            return [], False
        url = httpx.URL(self.base)
        pid = listening_pid(url.port or (443 if url.scheme == "https" else 80))
        return ([pid], False) if pid is not None else ([], True)

    def _remote(self) -> bool:
        """Whether the endpoint is on another machine (a path it names is then not a path here)."""
        host = httpx.URL(self.base).host
        return host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0") and not host.startswith("127.")

    def _json(self, path: str) -> dict | None:
        try:
            r = self._get(path)
            return r.json() if r.status_code == 200 and isinstance(r.json(), dict) else None
        except (httpx.HTTPError, ValueError):
            return None

    def warm_up(self) -> None:
        if not self.launching:
            for name in self.configs:
                self._warm(name)

    def _warm(self, name: str) -> None:
        req = Request("warm-up", [], 0, 0, *WARM_UP)
        self._one(name, req, time.perf_counter())

    def run(self, work: PhaseWork) -> Phase:
        """Run one phase, each request streamed on a thread of its own; records reach `on_record` on this thread."""
        config, load = work.config, work.load
        self._ensure(config)
        before = self._counters()
        done: queue.Queue[Record] = queue.Queue()
        threads: list[threading.Thread] = []

        def submit(req: Request) -> None:  # _record always returns a record: dispatch never waits on a lost one
            t = threading.Thread(target=lambda: done.put(self._record(config, load, req)), daemon=True)
            t.start()
            threads.append(t)

        def poll(timeout: float | None) -> list[Record]:
            try:
                out = [done.get(timeout=timeout)]
            except queue.Empty:
                return []
            while not done.empty():
                out.append(done.get_nowait())
            return out

        seconds = dispatch(work, submit, poll)
        for t in threads:
            t.join()
        return Phase(seconds, counter_delta(before, self._counters()))

    def _counters(self) -> dict | None:
        try:
            r = self._get("/metrics")
        except httpx.HTTPError:
            return None
        return parse_spec_counters(r.text) if r.status_code == 200 else None

    def deadline(self, req: Request) -> float:
        """Seconds one request may take from its start to its last byte: --request-timeout, else a generous bound
        from its max_tokens."""
        if self.request_timeout is not None:
            return self.request_timeout
        return DEADLINE_BASE_S + DEADLINE_PER_TOKEN_S * req.max_tokens

    def _record(self, config: str, load: Load, req: Request) -> Record:
        """One request's record; whatever the server answers (an error, a malformed stream, a dropped connection),
        a record comes back — an error record then — so the phase goes on."""
        t0 = time.perf_counter()
        rec = Record(config, load.name, req.task_id, req.repeat, req.groups, req.seed, t0, t0)
        try:
            return self._fill(rec, self._one(config, req, t0), t0)
        except SpecwiseError as exc:
            rec.finished, rec.error = time.perf_counter(), str(exc)
        except Exception as exc:  # a response no client should have to read: this request's error, not the run's
            rec.finished = time.perf_counter()
            rec.error = f"the server's response could not be read ({type(exc).__name__}: {str(exc)[:200]})"
        return rec

    def _fill(self, rec: Record, out: dict, t0: float) -> Record:
        chunks, usage = out["chunks"], out["usage"] or {}
        rec.finished = out["finished"]
        rec.output, rec.finish_reason = out["text"], out["finish_reason"]
        rec.prompt_tokens = _count(usage.get("prompt_tokens", 0), "prompt_tokens")
        rec.output_tokens = _count(usage.get("completion_tokens", len(chunks)), "completion_tokens")
        rec.ttft = chunks[0] - t0 if chunks else None
        rec.itl = [b - a for a, b in itertools.pairwise(chunks)]
        rec.e2e = rec.finished - t0
        rec.decode = chunks[-1] - chunks[0] if chunks else None
        rec.prefill = out["prefill"]
        rec.chunks = [[t - t0, n] for t, n in out["rendered"]]
        rec.spec = out["spec"]
        if rec.spec is not None:
            bound_by_tokens(rec.spec, rec.output_tokens)
        rec.verify = out["verify"]  # only a specwise server says; the audit then knows its evidence
        return rec

    def _one(self, config: str, req: Request, t0: float) -> dict:
        """Stream one request; returns text, chunk arrival times, finish reason, usage and spec statistics."""
        chat = isinstance(req.prompt, list)
        body = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "seed": req.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(self.configs[config].options or {}),
        }
        body["messages" if chat else "prompt"] = req.prompt
        url = self.base + ("/v1/chat/completions" if chat else "/v1/completions")
        text: list[str] = []
        chunks: list[float] = []
        rendered: list[tuple[float, int]] = []  # arrival time and characters of each piece of text
        finish, usage, spec, prefill, verify = None, None, None, None, None
        limit = self.deadline(req)
        deadline = t0 + limit
        # Each read waits at most the time left; between reads the deadline is checked: a stream ends by then.
        per_read = httpx.Timeout(min(self.read_timeout, limit), connect=10.0)
        try:
            with self.client.stream("POST", url, json=body, timeout=per_read) as r:
                if r.status_code != 200:
                    r.read()
                    raise SpecwiseError(f"HTTP {r.status_code}: {_error_message(r)}")
                for line in _lines(r, deadline, limit):
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        raise SpecwiseError(f"the server sent a stream line that is not JSON: {data[:200]!r}") from None
                    if not isinstance(obj, dict):
                        raise SpecwiseError(f"the server sent a stream line that is not a JSON object: {data[:200]!r}")
                    if "error" in obj:
                        raise SpecwiseError(f"the server failed mid-stream: {_error_message(obj)}")
                    if obj.get("usage") is not None and not isinstance(obj["usage"], dict):
                        raise SpecwiseError(f"the server sent 'usage' that is not an object: {obj['usage']!r:.200}")
                    usage = obj.get("usage") or usage
                    if _final(obj):  # only a closing chunk carries statistics: keep text chunks cheap
                        spec = spec_from_payload(obj) or spec  # whichever server's form it reports (server_reports)
                        own = own_speculative(obj)
                        prefill = own.get("prefill_time", prefill)  # specwise's own timing, when it is the server
                        verify = own.get("verify", verify)  # specwise: how sampled drafts were verified
                    choices = obj.get("choices") or []
                    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                        raise SpecwiseError(f"the server sent 'choices' that are not a list of objects: {data[:200]!r}")
                    for choice in choices:
                        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if piece is not None and not isinstance(piece, str):
                            raise SpecwiseError(f"the server sent text that is not a string: {piece!r:.200}")
                        if piece:
                            text.append(piece)
                            chunks.append(time.perf_counter())
                            rendered.append((chunks[-1], len(piece)))
                        finish = choice.get("finish_reason") or finish
        except httpx.TimeoutException:
            raise SpecwiseError(f"no answer within the request's deadline of {limit:g} s (--request-timeout)") from None
        except httpx.HTTPError as exc:
            raise SpecwiseError(f"request to {url} failed: {type(exc).__name__}: {exc}") from None
        return {
            "text": "".join(text),
            "chunks": chunks,
            "finish_reason": finish,
            "usage": usage,
            "spec": spec,
            "prefill": prefill,
            "verify": verify,
            "rendered": rendered,
            "finished": time.perf_counter(),
        }


# A watchdog process per launched server: it holds the read end of a pipe only this process writes to. An orderly
# stop writes "ok" first; if this process dies any other way (kill -9 included) the pipe closes unwritten and the
# watchdog stops the server's whole process group, so no server outlives the run that launched it.
_REAPER = """
import os, signal, sys, time
pgid = int(sys.argv[1])
if sys.stdin.buffer.read() != b"ok":
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        for _ in range(100):
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                sys.exit(0)
            time.sleep(0.1)
"""


def _reaper(pgid: int) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _REAPER, str(pgid)], stdin=subprocess.PIPE, start_new_session=True
        )
    except OSError:
        return None


def _listener(port: int) -> str | None:
    """Which process listens on TCP `port` ("pid 123: llama-server -m …"), from /proc, where this user can see it."""
    pid = listening_pid(port)
    if pid is None:
        return None
    with contextlib.suppress(OSError):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        return f"pid {pid}: {redact(cmd[:160])}"
    return f"pid {pid}"


def _lines(r: httpx.Response, deadline: float, limit: float):
    """The stream's lines, within the request's deadline and the caps on a line's and the whole stream's size."""
    pending, total = b"", 0
    for piece in r.iter_bytes():
        total += len(piece)
        if total > MAX_RESPONSE_BYTES:
            raise SpecwiseError(f"the server's stream passed {MAX_RESPONSE_BYTES >> 20} MB for one request")
        if time.perf_counter() > deadline:
            raise SpecwiseError(
                f"the stream did not end within the request's deadline of {limit:g} s (--request-timeout)"
            )
        pending += piece
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LINE_BYTES:
            raise SpecwiseError(f"the server sent a stream line over {MAX_LINE_BYTES >> 20} MB")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", "replace")


def bound_by_tokens(spec: SpecCounts, output_tokens: int) -> None:
    """Refuse speculation counts the request's own tokens cannot hold (a malformed response): every verification
    step and every accepted draft token yields an output token."""
    if spec.steps > output_tokens + 1 or spec.accepted > output_tokens:
        raise SpecwiseError(
            f"the server reported {spec.steps} verification steps and {spec.accepted} accepted draft tokens for "
            f"{output_tokens} output tokens: not counts of this request"
        )


def _count(value: object, name: str) -> int:
    """A token count from the server's usage, or the request's error naming what came instead."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecwiseError(f"the server reported usage.{name} = {value!r:.80}, not a count of tokens")
    return value


def _final(obj: dict) -> bool:
    """Whether a stream chunk can carry the request's statistics: usage, timings, metrics, or a finish reason."""
    return bool(
        obj.get("usage")
        or obj.get("timings")
        or obj.get("metrics")
        or obj.get("speculative")
        or any(c.get("finish_reason") for c in obj.get("choices") or [] if isinstance(c, dict))
    )


def _error_message(obj) -> str:
    if isinstance(obj, httpx.Response):
        try:
            obj = obj.json()
        except ValueError:
            return obj.text[:300]
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err or obj)[:300]
