"""Streaming capture beside a live serving loop, with the consumer in its own process.

    python examples/streaming_capture.py --out /tmp/hs-stream

The "engine" here is a batched greedy decode loop over the embedded tiny Llama (HF
transformers, KV cache). Each forward's rows go into the shared-memory ring and are announced;
`hscapture consume` copies them out and writes the store. The policy is `drop`: the serving
loop never waits for the consumer, and whatever could not be captured is counted. In
production you start the consumer yourself, in another terminal or service:

    hscapture consume --endpoint ipc:///tmp/hscapture-$UID/demo --out /tmp/hs-stream
"""

import argparse
import os
import subprocess
import time
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from hscapture import CaptureConfig, Producer, open_store
from hscapture.consumer import consume_command
from hscapture.integrations.hf import HFCapture, describe, greedy_generate
from hscapture.tiny import demo_conversations, ensure_tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, default=Path("/tmp/hs-stream"))
parser.add_argument("--waves", type=int, default=4, help="batches of requests to serve")
parser.add_argument("--batch", type=int, default=8, help="requests per batch")
parser.add_argument("--new-tokens", type=int, default=32)
args = parser.parse_args()


def say(text: str) -> None:
    print(text, flush=True)


say("loading the embedded tiny Llama (built once under ~/.cache/hscapture) ...")
model_dir = ensure_tiny_model()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
layers = (2, 4, 5)
endpoint = f"ipc:///tmp/hscapture-{os.getuid()}/demo-{os.getpid()}"
config = CaptureConfig(
    layers=layers,
    hidden_size=model.config.hidden_size,
    num_layers=model.config.num_hidden_layers,
    policy="drop",
    endpoint=endpoint,
    max_step_rows=4096,
)
say(f"starting the consumer: hscapture consume --endpoint {endpoint} --out {args.out} ...")
consumer = subprocess.Popen(consume_command(endpoint, args.out, "--exit-on-eos", "--quiet"))
producer = Producer(config, tensor_descriptions=describe(layers, True), meta={"engine": "hf-greedy-loop"})
waiting = time.monotonic()
while not producer.attached:  # a real server would just start serving; here we want every row
    producer.poll()
    time.sleep(0.01)
say(
    f"the consumer attached after {time.monotonic() - waiting:.1f} s; "
    f"serving {args.waves} waves of {args.batch} requests"
)

prompts = [c["messages"][:-1] for c in demo_conversations(args.waves * args.batch)]
started, served = time.monotonic(), 0
with HFCapture(model, layers) as capture:
    for wave in range(args.waves):
        chats = prompts[wave * args.batch : (wave + 1) * args.batch]
        ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
        keys = [f"wave{wave}-req{i}" for i in range(len(ids))]
        greedy_generate(model, capture, producer, ids, keys, args.new_tokens, tokenizer.pad_token_id)
        served += len(ids) * args.new_tokens
        counters = producer.counters
        say(
            f"wave {wave + 1}/{args.waves}: {served} tokens served, {counters.rows_captured} rows captured, "
            f"{counters.rows_dropped} dropped"
        )
say("ending the stream; the consumer finishes the store ...")
counters = producer.close()
consumer.wait(60)
seconds = time.monotonic() - started
say(
    f"served {served} tokens in {seconds:.1f} s; captured {counters.rows_captured} rows, dropped "
    f"{counters.rows_dropped} (drop policy: serving never waited for the consumer)"
)
summary = open_store(args.out).summary()
say(
    f"store {args.out}: {summary['complete']} complete requests, {summary['rows']} rows, "
    f"{summary['bytes'] / 2**20:.1f} MiB in {summary['shards']} shard(s)\n"
    f"read it: python -c \"from hscapture import open_store; s = open_store('{args.out}'); "
    'print(s.get(s.keys()[0]))"\n'
    f"inspect it: hscapture inspect {args.out}"
)
