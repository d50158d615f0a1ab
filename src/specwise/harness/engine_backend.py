"""The in-process engine backend: every configuration on one copy of the target weights, prefill, decode and
speculation statistics from the engine itself. The engine (torch) is imported only when this backend is built, so
the rest of the harness never imports torch."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from specwise.errors import SpecwiseError
from specwise.harness.backends import WARM_UP, Phase, PhaseWork, Request, dispatch
from specwise.harness.config import Config
from specwise.harness.facts import hardware
from specwise.harness.load import Load
from specwise.harness.store import Record
from specwise.specs import DEFAULT_MAX_BATCH, HARNESS_MAX_LEN, VERIFY_METHODS, TargetOptions


def phase_history(load: str, repeat: int) -> str:
    """Whose cross-request history (suffix drafting) a request of this load and repeat drafts from and adds to: its
    own, so that the other repeats and loads — the same tasks again, whose outputs a suffix drafter would copy
    whole — are not in it (with one history the second repeat's questions ran 1.68x where the first ran 1.15x).
    Within a load and repeat each task runs once and the later ones meet the earlier ones' outputs, as traffic
    does. The replay in `specwise predict` keeps the same histories. It is also the tenant whose cache rows a prompt
    may start from (`Engine._admit`): a repeat never reads its own prompt from the rows its earlier run left."""
    return f"{load}#{repeat}"


class EngineBackend:
    """Runs configurations on the in-process engine; one target load, one engine per configuration."""

    whole_phases = False

    def __init__(
        self,
        target: TargetOptions,
        configs: list[Config],
        max_batch: int = DEFAULT_MAX_BATCH,
        max_len: int = HARNESS_MAX_LEN,
        temperature: float = 0.0,
        verify: str = VERIFY_METHODS[0],
    ):
        from specwise.engine import Engine, load_target

        self.target = load_target(target)
        self.temperature = temperature
        self._facts: dict[str, dict] = {}
        self.engines = {
            c.name: Engine(
                self.target, drafter=c.drafter, k=c.k, max_batch=max_batch, max_len=max_len, verify=c.verify or verify
            )
            for c in configs
        }

    def info(self) -> dict:
        """Provenance: target identity, each configuration's drafter and its extra resources, hardware."""
        from specwise.engine.weights import device_info

        dev = self.target.device
        hw = {**hardware(), **device_info(self.target)}
        configs = {}
        for name, e in self.engines.items():
            d = e.drafter
            configs[name] = {
                "drafter": d.name if d else None,
                "k": e.k_spec if d else None,
                "draft_extra_memory_bytes": d.extra_memory_bytes() if d else 0,
                "draft_device": str(dev) if d else None,
                "draft_identity": d.provenance(self.target.identity.sha256) if d else None,
            }
        return {"target": self.target.identity.to_dict(), "configs": configs, "hardware": hw, "backend": "engine"}

    def facts(self, config: str) -> dict | None:
        """From this configuration's own engine: the target it runs, this specwise, this machine (read once: the
        runner asks after every phase)."""
        from specwise import __version__
        from specwise.engine.weights import device_info

        if config not in self._facts:
            target = self.engines[config].target
            self._facts[config] = {
                "target": target.identity.to_dict(),
                "server": {"kind": "specwise (in process)", "version": __version__},
                "hardware": {**hardware(), **device_info(target)},
            }
        return self._facts[config]

    def warm_up(self) -> None:
        """One short generation per configuration, so the first measured request pays no one-time costs."""
        from specwise.engine import SamplingParams

        for e in self.engines.values():
            e.generate([WARM_UP[0]], SamplingParams(max_new_tokens=WARM_UP[1]))

    def run(self, work: PhaseWork) -> Phase:
        """Run one phase on this configuration's engine, stepping it on this thread."""
        from specwise.engine import SamplingParams
        from specwise.engine.request import RequestOptions

        config, load = work.config, work.load
        engine = self.engines[config]
        live: dict[str, InFlight] = {}  # request id → the request, when it was submitted, its chunks
        refused: list[Record] = []

        def submit(req: Request) -> None:
            params = SamplingParams(max_new_tokens=req.max_tokens, temperature=self.temperature, seed=req.seed)
            options = RequestOptions(tenant=phase_history(load.name, req.repeat))
            now = time.perf_counter()
            try:
                live[engine.submit(req.prompt, params, options)] = InFlight(req, now, [])
            except SpecwiseError as exc:
                refused.append(
                    Record(config, load.name, req.task_id, req.repeat, req.groups, req.seed, now, now, error=str(exc))
                )

        def poll(timeout: float | None) -> list[Record]:
            done = refused[:]
            refused.clear()
            if done:
                return done
            if not engine.has_work:  # open loop, nothing in flight: wait for the next arrival
                time.sleep(timeout or 0.0)
                return []
            for event in engine.step():
                flight = live[event.request_id]
                t = time.perf_counter()
                if event.token_ids:
                    flight.chunks.append((t, len(event.text)))
                if event.result is not None:
                    del live[event.request_id]
                    done.append(_record(config, load, flight, t, event.result, engine.verify))
            return done

        return Phase(dispatch(work, submit, poll))

    def close(self) -> None:
        """Nothing to release: the engines go with the backend."""

    def observed(self) -> tuple[list[int], bool]:
        """The engines run in this process (their kernel threads too)."""
        return [], False


@dataclass
class InFlight:
    """A request the engine is running: when it was submitted, and its chunks as they arrive (time, characters)."""

    req: Request
    submitted: float
    chunks: list[tuple[float, int]] = field(default_factory=list)


def _record(config: str, load: Load, flight: InFlight, finished: float, result, verify: str) -> Record:
    req, submitted, chunks = flight.req, flight.submitted, flight.chunks
    s = result.stats
    times = [t for t, _ in chunks]
    return Record(
        config,
        load.name,
        req.task_id,
        req.repeat,
        req.groups,
        req.seed,
        submitted,
        finished,
        output=result.text,
        prompt_tokens=s.prompt_tokens,
        output_tokens=s.generated_tokens,
        finish_reason=result.finish_reason,
        ttft=times[0] - submitted if times else None,
        itl=[b - a for a, b in itertools.pairwise(times)],
        chunks=[[t - submitted, n] for t, n in chunks if n],  # what a reader sees arrive: time, characters
        e2e=finished - submitted,
        prefill=s.prefill_time,
        decode=s.decode_time,
        spec=s.counts(),
        verify=verify,  # "coupled": a seeded output is plain decoding's
        tokens=list(result.token_ids),  # what `specwise predict` replays drafters over
    )
