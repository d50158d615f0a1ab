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

import itertools
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from specwise.errors import SpecwiseError
from specwise.harness.backends import Config, Phase, Request, check_comparable, dispatch, hardware
from specwise.harness.load import Load
from specwise.harness.server_stats import counter_delta, parse_spec_counters, spec_from_payload
from specwise.harness.store import Record


class HTTPBackend:
    """Runs configurations against an OpenAI-compatible endpoint, launching a server per configuration if asked."""

    def __init__(
        self,
        endpoint: str,
        model: str | None,
        configs: list[Config],
        api_key: str | None = None,
        temperature: float = 0.0,
        timeout: float = 600.0,
        launch_timeout: float = 600.0,
        log_dir: Path | None = None,
    ):
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

    def _start(self, name: str) -> None:
        cmd = self.configs[name].launch
        log_path = (self.log_dir or Path(".")) / f"server-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it until stopped
        try:
            self.proc = subprocess.Popen(shlex.split(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except (OSError, ValueError) as exc:
            raise SpecwiseError(f"--launch for {name!r}: cannot start {cmd!r} ({exc})") from None
        finally:
            log.close()
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
            "configs": {n: {"launch": c.launch, "options": c.options} for n, c in self.configs.items()},
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
        entry: dict = next((m for m in (own or {}).get("data") or [] if m.get("id") == self.model), {})
        if entry.get("specwise"):
            own_info = entry["specwise"]
            server = {"kind": "specwise", "version": own_info.get("version"), "kernels": own_info.get("kernels")}
        elif (props := self._json("/props")) and "build_info" in props:
            server = {"kind": "llama.cpp", "version": props.get("build_info")}
            target.setdefault("path", props.get("model_path"))
        elif (ver := self._json("/version")) and "version" in ver:
            server = {"kind": "vllm", "version": ver.get("version")}
        elif (info := self._json("/get_server_info")) and "version" in info:
            server = {"kind": "sglang", "version": info.get("version")}
        return {"target": target, "server": server, "hardware": {**hardware(), "measured_from": "client"}}

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
        req = Request("warm-up", [], 0, 0, "Hello, world. Hello", 8)
        self._one(name, req, time.perf_counter())

    def run(
        self,
        config: str,
        load: Load,
        requests: list[Request],
        on_record: Callable[[Record], None],
        progress: Callable[[], None] | None = None,
    ) -> Phase:
        """Run one phase, each request streamed on a thread of its own; records reach `on_record` on this thread."""
        self._ensure(config)
        before = self._counters()
        done: queue.Queue[Record] = queue.Queue()
        threads: list[threading.Thread] = []

        def submit(req: Request) -> None:
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

        seconds = dispatch(load, requests, submit, poll, on_record, progress)
        for t in threads:
            t.join()
        return Phase(seconds, counter_delta(before, self._counters()))

    def _counters(self) -> dict | None:
        try:
            r = self._get("/metrics")
        except httpx.HTTPError:
            return None
        return parse_spec_counters(r.text) if r.status_code == 200 else None

    def _record(self, config: str, load: Load, req: Request) -> Record:
        t0 = time.perf_counter()
        rec = Record(config, load.name, req.task_id, req.repeat, req.groups, req.seed, t0, t0)
        try:
            out = self._one(config, req, t0)
        except SpecwiseError as exc:
            rec.finished, rec.error = time.perf_counter(), str(exc)
            return rec
        chunks, usage = out["chunks"], out["usage"] or {}
        rec.finished = out["finished"]
        rec.output, rec.finish_reason = out["text"], out["finish_reason"]
        rec.prompt_tokens = usage.get("prompt_tokens", 0)
        rec.output_tokens = usage.get("completion_tokens", len(chunks))
        rec.ttft = chunks[0] - t0 if chunks else None
        rec.itl = [b - a for a, b in itertools.pairwise(chunks)]
        rec.e2e = rec.finished - t0
        rec.decode = chunks[-1] - chunks[0] if chunks else None
        rec.prefill = out["prefill"]
        rec.chunks = [[t - t0, n] for t, n in out["rendered"]]
        if out["spec"] is not None:
            rec.spec = out["spec"].to_dict()
        if out["verify"] is not None:  # only a specwise server says; the audit then knows its evidence
            rec.spec = {**rec.spec, "verify": out["verify"]}
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
        try:
            with self.client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise SpecwiseError(f"HTTP {r.status_code}: {_error_message(r)}")
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        raise SpecwiseError(f"the server sent a stream line that is not JSON: {data[:200]!r}") from None
                    if "error" in obj:
                        raise SpecwiseError(f"the server failed mid-stream: {_error_message(obj)}")
                    usage = obj.get("usage") or usage
                    if _final(obj):  # only a closing chunk carries statistics: keep text chunks cheap
                        spec = spec_from_payload(obj) or spec  # whichever server's form it reports (server_stats)
                        own = obj.get("speculative") or (obj.get("usage") or {}).get("speculative") or {}
                        prefill = own.get("prefill_time", prefill)  # specwise's own timing, when it is the server
                        verify = own.get("verify", verify)  # specwise: how sampled drafts were verified
                    for choice in obj.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if piece:
                            text.append(piece)
                            chunks.append(time.perf_counter())
                            rendered.append((chunks[-1], len(piece)))
                        finish = choice.get("finish_reason") or finish
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
