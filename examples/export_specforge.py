"""Capture with the tiny model, export for SpecForge, and load the files the way SpecForge does.

    python examples/export_specforge.py --out /tmp/hs-specforge [--samples 16]

Extracts EAGLE-3's aux layers (2, L/2, L-3) and the post-norm final state of the embedded tiny
Llama into a store, exports it with `hscapture export STORE OUT --format specforge`, then opens
every file as SpecForge's offline reader does (walk OUT for ``*.ckpt``, ``torch.load(...,
mmap=True)``; ``aux_hidden_state`` is the drafter's input, ``hidden_state`` its target) and
checks each against the store. tests/test_export.py runs SpecForge's own loader over such an
export. Train with SpecForge's offline mode pointed at OUT/specforge.
"""

import argparse
import json
import os
from pathlib import Path

import torch

from hscapture import open_store
from hscapture.export import MANIFEST, ExportOptions, export
from hscapture.extract import ExtractOptions, extract
from hscapture.tiny import write_demo_jsonl

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, default=Path("/tmp/hs-specforge"))
parser.add_argument("--samples", type=int, default=16)
args = parser.parse_args()
store_dir, export_dir = args.out / "store", args.out / "specforge"

data = write_demo_jsonl(args.out / "demo.jsonl", n=args.samples)
extract(ExtractOptions(out=store_dir, data=data, progress=False))  # layers 2, 4, 5 and `last` of the 8-layer model
summary = export(ExportOptions(store=store_dir, out=export_dir, format="specforge", progress=False))
print(f"exported {summary.total} samples to {export_dir} (aux {', '.join(summary.aux)}; final {summary.final})")

# As SpecForge reads them: every .ckpt below the directory, memory-mapped.
files = sorted(os.path.join(root, f) for root, _, names in os.walk(export_dir) for f in names if f.endswith(".ckpt"))
store = open_store(store_dir)
lines = [json.loads(line) for line in (export_dir / MANIFEST).read_text().splitlines()]
request_of = {line["index"]: line["id"] for line in lines if line["type"] == "sample"}  # data_{i} <- request id
for path in files:
    data = torch.load(path, weights_only=False, mmap=True)
    sample = store.get(request_of[int(Path(path).stem.removeprefix("data_"))])
    assert torch.equal(data["input_ids"], sample["input_ids"])
    assert torch.equal(data["aux_hidden_state"][0], torch.cat([sample[n] for n in summary.aux], dim=-1))
    assert torch.equal(data["hidden_state"][0], sample["last"])
print(f"loaded {len(files)} files as SpecForge does; each equals the store, bit for bit")
first = torch.load(files[0], weights_only=False, mmap=True)
for name, tensor in first.items():
    print(f"  {name:17s} {tuple(tensor.shape)} {tensor.dtype}")
