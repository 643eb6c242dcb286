"""Streaming capture from a live SGLang server: `hscapture serve`, OpenAI-compatible requests, Ctrl-C.

    python examples/sglang_serve.py --out /tmp/hs-sglang [--model-path DIR]

Starts `hscapture serve --out DIR -- --model-path MODEL ...` (SGLang's HTTP server with the
hscapture plugin capturing the EAGLE-3 states of every request, plus the consumer writing the
store), sends a few chat requests with their own ids, then stops it the way a user does (SIGINT)
and reads the store: those requests and nothing else (SGLang's warm-up and health checks are not
captured), the run ended cleanly. With no --model-path it serves the embedded tiny Llama; on a host
without a GPU, `hscapture serve` runs SGLang's CPU path.
"""

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hscapture import open_store
from hscapture.tiny import ensure_tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, default=Path("/tmp/hs-sglang"))
parser.add_argument("--model-path", type=Path, help="HF model directory (default: the embedded tiny Llama)")
parser.add_argument("--requests", type=int, default=4)
args = parser.parse_args()

model = args.model_path or ensure_tiny_model()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
# block: this demo reads back every request it sent, so serving waits for the consumer (on a busy host it may attach
# after the first requests are served). The default, drop, never makes serving wait and counts what it drops.
serve = [sys.executable, "-m", "hscapture", "serve", "--out", str(args.out), "--policy", "block"]
sglang_args = [
    "--model-path",
    str(model),
    "--port",
    str(port),
    "--mem-fraction-static",
    "0.3",
    "--log-level",
    "warning",
]
server = subprocess.Popen([*serve, "--", *sglang_args])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 600
while True:  # SGLang takes a while to load; poll its health endpoint
    if server.poll() is not None:
        sys.exit(f"hscapture serve exited with {server.returncode}")
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5):
            break
    except OSError:
        if time.monotonic() > deadline:
            server.kill()
            sys.exit("SGLang did not come up in 600 s")
        time.sleep(1)

questions = ["What is a hidden state?", "Name three colours.", "Count to five.", "Why is the sky blue?"]
for i in range(args.requests):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": questions[i % len(questions)]}],
        "max_tokens": 16,
        "temperature": 0,
        "rid": f"example-{i}",  # the request id is the store key
    }
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
    print(f"example-{i}: {reply['usage']['prompt_tokens']} prompt + {reply['usage']['completion_tokens']} tokens")

server.send_signal(signal.SIGINT)  # what Ctrl-C does: the server stops, the store is finished
server.wait(180)
store = open_store(args.out)
summary = store.summary()
ended = store.metadata()["runs"][-1]["end"]["reason"]  # "end of stream": a clean stop
print(f"store {args.out}: {summary['complete']} complete requests, {summary['rows']} rows; the run ended: {ended}")
rows = store.get("example-0")
print("example-0:", {name: tuple(t.shape) for name, t in rows.items()})
