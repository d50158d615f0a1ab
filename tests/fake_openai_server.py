"""A stand-in OpenAI-compatible server for harness tests, with a controllable flaw: its greedy output of a prompt is
the prompt reversed, with " [batched]" appended when another request is in flight at the end of this one
(`--batch-variant`, as llama.cpp's batched greedy decoding) and "!" appended always (`--lossy`, a speculation that
changes outputs). With `--speculative` it reports drafts as llama-server does: `timings.draft_n` per request and
`llamacpp:spec_decode_*` counters. Usage: python fake_openai_server.py --port P [--batch-variant] [--speculative]
[--lossy]"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--batch-variant", action="store_true")
parser.add_argument("--speculative", action="store_true")
parser.add_argument("--lossy", action="store_true")
parser.add_argument("--model", default="fake")
parser.add_argument("--text", help="answer this text instead (chunks: its words)")
parser.add_argument("--gap", type=float, default=0.0, help="seconds between chunks")
parser.add_argument("--stall", help="I:S — wait S seconds before chunk I")
args = parser.parse_args()

lock = threading.Lock()
active: set[int] = set()
state = {"overlapped": set(), "drafts": 0, "drafted": 0, "accepted": 0, "next": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, b'{"status":"ok"}')
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": args.model, "object": "model"}]}).encode())
        elif self.path == "/props":  # as llama-server: its build and the model file it serves
            self._send(200, json.dumps({"build_info": "fake-1", "model_path": f"/models/{args.model}"}).encode())
        elif self.path == "/metrics":
            text = "".join(
                f"llamacpp:spec_decode_{k}_total {state[v]}\n"
                for k, v in (
                    ("num_drafts", "drafts"),
                    ("num_draft_tokens", "drafted"),
                    ("num_accepted_tokens", "accepted"),
                )
            )
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, b'{"error":{"message":"not found"}}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body.get("prompt") or json.dumps(body.get("messages"))
        with lock:
            me = state["next"]
            state["next"] += 1
            active.add(me)
            if len(active) > 1:  # every request now in flight shares a batch with another
                state["overlapped"].update(active)
        time.sleep(0.15)  # long enough for concurrent requests to overlap
        with lock:
            active.discard(me)
            batched = me in state["overlapped"]
        text = args.text or prompt[::-1][:40] + (" [batched]" if args.batch_variant and batched else "")
        text += "!" if args.lossy else ""
        stall_at, stall = (int(args.stall.split(":")[0]), float(args.stall.split(":")[1])) if args.stall else (-1, 0.0)
        words = text.split(" ")
        timings = {"prompt_n": len(prompt), "predicted_n": len(words)}
        if args.speculative:
            with lock:
                state["drafts"] += 2
                state["drafted"] += 6
                state["accepted"] += 4
            timings.update(draft_n=6, draft_n_accepted=4)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = "messages" in body
        for i, w in enumerate(words):
            time.sleep(stall if i == stall_at else (args.gap if i else 0.0))
            piece = w if i == 0 else " " + w
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        final = {
            "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(words)},
            "timings": timings,
        }
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
