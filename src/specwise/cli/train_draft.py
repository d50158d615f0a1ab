"""`specwise train-draft --from FILE --out DIR`: train an EAGLE-3 draft head for the target on your own prompts —
the target answers each itself, its features and distributions are collected, the head is trained on the CPU
(engine.draft_train) and written as a speculators directory that `--drafter eagle:DIR` and vLLM both load.

FILE is a JSONL file with a `prompt` or `messages` per line, a workload file (what `evaluate --workload` takes), or
a request log written by `specwise serve --log PATH --log-text`. Everything is checked before anything is written.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import sqlite3
import sys
import time
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.models import MODEL_HELP

SQLITE_MAGIC = b"SQLite format 3\x00"
EXAMPLES = "examples.safetensors"
TRAINING = "training.json"


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    from specwise.specs import TrainOptions

    d = TrainOptions()
    p = sub.add_parser(
        "train-draft",
        help="train an EAGLE-3 draft head for the target on your prompts (--drafter eagle:DIR, or vLLM's eagle3)",
    )
    p.add_argument("--from", dest="source", required=True, metavar="FILE", help="JSONL, workload file or request log")
    p.add_argument("--out", required=True, metavar="DIR", help="where the head is written (a checkpoint resumes)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens the target answers each prompt with")
    p.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head drafts from (the most frequent)")
    p.add_argument("--limit", type=int, help="use at most this many prompts (the first ones)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (one cycle)")
    p.add_argument("--steps", type=int, default=d.steps, help="unrolled drafting steps trained (training-time test)")
    p.add_argument("--k", type=int, default=d.k, help="draft length the held-out acceptance is measured at")
    p.add_argument("--held-out", type=float, default=d.held_out, help="share of the prompts kept for measuring")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded positions per optimiser step")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--precision",
        default=d.precision,
        help="matrix products in training: bfloat16, float32, or auto (bfloat16 where the CPU has AVX512-BF16 or AMX)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def read_prompts(path: Path) -> list[str | list[dict]]:
    """The prompts in FILE (text, or chat messages), in order; a clear error for anything else."""
    try:
        head = path.open("rb").read(16)
    except FileNotFoundError:
        raise SpecwiseError(f"--from {path}: no such file") from None
    except OSError as exc:
        raise SpecwiseError(f"--from {path}: cannot read it ({exc.strerror})") from None
    if head == SQLITE_MAGIC:
        prompts = _from_log(path)
    elif path.suffix.lower() == ".jsonl":
        prompts = _from_jsonl(path)
    else:
        from specwise.harness.workload import load_workload

        prompts = [t.request for t in load_workload(path).tasks]
    if not prompts:
        raise SpecwiseError(f"--from {path}: no prompts in it (give at least 2: one is held out to measure the head)")
    return prompts


def _check_messages(messages: object, where: str) -> list[dict]:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)
    ):
        raise SpecwiseError(f"{where}: messages must be a non-empty list of {{'role': ..., 'content': ...}}")
    return [dict(m) for m in messages]


def _from_jsonl(path: Path) -> list[str | list[dict]]:
    out: list[str | list[dict]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise SpecwiseError(f"--from {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--from {path}, line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecwiseError(f"{where}: not JSON ({exc.msg}); each line must be one object") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise SpecwiseError(f"{where}: give an object with a 'prompt' (text) or 'messages' (chat), one of them")
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise SpecwiseError(f"{where}: 'prompt' must be non-empty text")
            out.append(row["prompt"])
        else:
            out.append(_check_messages(row["messages"], where))
    return out


def _from_log(path: Path) -> list[str | list[dict]]:
    from specwise.paths import sqlite_readonly_uri

    try:
        con = sqlite3.connect(sqlite_readonly_uri(path), uri=True)
        columns = {r[1] for r in con.execute("PRAGMA table_info(log)")}
        kind = "chat" if "chat" in columns else "NULL"  # logs from before the prompt's kind was recorded: NULL
        rows = con.execute(f"SELECT prompt, {kind} FROM log ORDER BY time").fetchall()
        con.close()
    except sqlite3.Error as exc:
        raise SpecwiseError(f"--from {path}: not a specwise request log ({exc})") from None
    texts = [(text, chat) for text, chat in rows if text]
    if rows and not texts:
        raise SpecwiseError(
            f"--from {path}: the log holds {len(rows)} requests but no prompt text: serve with --log-text to log it"
        )
    out: list[str | list[dict]] = []
    for text, chat in texts:
        if chat == 0 or (chat is None and not text.startswith("[")):  # a completion prompt, whatever it looks like
            out.append(text)
            continue
        messages = _parse_messages(text)
        if chat is None:  # an older log: messages if they read as messages, else a prompt that starts with '['
            try:
                out.append(_check_messages(messages, f"--from {path}"))
            except SpecwiseError:
                out.append(text)
        elif messages is None:
            raise SpecwiseError(f"--from {path}: a chat request's messages are not readable JSON")
        else:
            out.append(_check_messages(messages, f"--from {path}"))
    return out


def _parse_messages(text: str) -> object | None:
    """Chat messages as the log keeps them (JSON; older logs: Python's repr), or None where the text is neither
    (nested too deeply included: 2,000 '[' is a prompt, not a crash)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def run(args: argparse.Namespace) -> int:
    from specwise.engine import Engine, load_target
    from specwise.engine import draft_data as D
    from specwise.engine import draft_train as T
    from specwise.engine import eagle as E
    from specwise.engine.native import NativeDecoder

    options = T.TrainOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(T.TrainOptions)})
    options.check()
    if args.max_tokens < 2:
        raise SpecwiseError(f"--max-tokens {args.max_tokens} is not allowed: give at least 2")
    if args.limit is not None and args.limit < 2:
        raise SpecwiseError(f"--limit {args.limit} is not allowed: give at least 2 prompts")
    source = Path(args.source)
    prompts = read_prompts(source)[: args.limit]
    if len(prompts) < 2:
        raise SpecwiseError(f"--from {source}: {len(prompts)} prompt; give at least 2 (one is held out)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SpecwiseError(f"--out {out} is a file: give a directory")
    T.refuse_pickles(out)
    if (out / E.CONFIG).exists() and not (out / T.CHECKPOINT).exists():
        raise SpecwiseError(f"--out {out} already holds a trained head: give a new directory")
    target = load_target(args.model)
    model = target.model
    if not isinstance(model, NativeDecoder):
        raise SpecwiseError("a draft head is trained for a Llama-family target on the CPU kernels (our decoder)")
    if args.draft_vocab < 1 or args.draft_vocab > model.cfg.vocab_size:
        raise SpecwiseError(f"--draft-vocab {args.draft_vocab} is not allowed: give 1..{model.cfg.vocab_size}")
    encoder = Engine(target, max_batch=1)  # the target's own context limits which prompts are refused
    ids = [encoder.encode_prompt(p) for p in prompts]
    for n, prompt_ids in enumerate(ids, 1):
        if len(prompt_ids) + args.max_tokens > encoder.max_len:
            raise SpecwiseError(
                f"--from {source}: prompt {n} is {len(prompt_ids)} tokens; with --max-tokens {args.max_tokens} it "
                f"exceeds the target's context of {encoder.max_len} tokens (shorten it or lower --max-tokens)"
            )
    layers = D.eagle_layers(model.num_layers)  # refuses a target too small before anything is written
    key = hashlib.sha256(json.dumps([ids, args.max_tokens, E.target_origin(target)]).encode()).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cached = out / EXAMPLES
    examples = None
    if cached.exists():
        examples = D.load_examples(cached, key)
        if examples is not None:
            print(f"using the {len(examples)} answers collected before ({cached})", file=sys.stderr)
    if examples is None:
        print(f"the target answers {len(ids)} prompts (≤ {args.max_tokens} tokens each) …", file=sys.stderr)
        examples = D.collect(target, ids, args.max_tokens, layers, progress=not args.no_progress)
        D.save_examples(cached, key, examples)
    collected = time.perf_counter() - t0
    answer_tokens = sum(ex.answer_len for ex in examples)
    head = T.untrained_head(
        target,
        examples,
        args.draft_vocab,
        {
            "target_name": target.identity.name,
            "data_source": str(source),
            "prompts": len(examples),
            "answer_tokens": answer_tokens,
            "options": {**vars(options), "max_tokens": args.max_tokens},
        },
    )
    provenance = head.spec.provenance
    print(
        f"training on {answer_tokens} answer tokens (draft vocabulary {head.spec.draft_vocab}, covering "
        f"{provenance['draft_vocab_coverage']:.1%} of them) …",
        file=sys.stderr,
    )

    def report(r: T.EpochReport) -> None:
        print(
            f"epoch {r.epoch}: loss {r.loss:.3f}, held-out acceptance length {r.acceptance_length:.2f} at k="
            f"{options.k} (step accuracy {', '.join(f'{a:.2f}' for a in r.step_accuracy)}), {r.seconds:.0f} s",
            file=sys.stderr,
        )

    history = T.train(head, examples, options, out, progress=not args.no_progress, report=report)
    E.save(head, out, options.k)
    summary = {
        **provenance,
        "collection_seconds": round(collected, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        **history.to_dict(),
    }
    (out / TRAINING).write_text(json.dumps(summary, indent=2) + "\n")
    for leftover in (out / T.CHECKPOINT, cached):
        leftover.unlink(missing_ok=True)
    last = history.epochs[-1]
    print(
        f"wrote {out}: held-out acceptance length {last.acceptance_length:.2f} at k={options.k}; use it with "
        f'--drafter eagle:{out} (or vLLM: --speculative-config \'{{"method": "eagle3", "model": "{out}"}}\')'
    )
    return 0
