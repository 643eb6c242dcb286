"""Offline bulk extraction through the Python API, then reading one sample back.

    python examples/offline_extract.py --out /tmp/hs-offline [--model DIR --data FILE.jsonl]

With no --model/--data it uses the embedded tiny Llama and 200 demo conversations. The CLI
equivalent is `hscapture extract --out /tmp/hs-offline`. Run it twice: the second run finds
every sample already captured and does nothing (that is how an interrupted run resumes).
"""

import argparse
from pathlib import Path

from hscapture import open_store
from hscapture.extract import ExtractOptions, extract

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, default=Path("/tmp/hs-offline"))
parser.add_argument("--model", type=Path)
parser.add_argument("--data", type=Path)
args = parser.parse_args()

summary = extract(ExtractOptions(out=args.out, model=args.model, data=args.data, progress=False))
print(f"captured {summary.samples} samples ({summary.tokens} tokens, {summary.tokens_per_s:.0f} tok/s)")

store = open_store(args.out)
key = store.keys()[0]
sample = store.get(key)
print(f"{len(store)} samples in {args.out}; sample {key!r}:")
for name, tensor in sample.items():
    print(f"  {name:10s} {tuple(tensor.shape)} {tensor.dtype}")
print("captured tensors:", *(f"\n  {t['name']}: {t['description']}" for t in store.metadata()["tensors"]))
