"""Train a tiny drafter-like head on captured hidden states: extract a store, read it through a DataLoader.

    python examples/train_reader.py --out /tmp/hs-train [--store-dtype fp8] [--samples 64] [--steps 40]

First extracts --samples demo conversations from the embedded tiny Llama into --out (samples
already there are skipped, so a rerun only trains). Then trains an EAGLE-3-like fusion head: the
captured aux layers of token t, concatenated ([seq, 3H]), mapped by one linear layer onto the
model's final hidden state of token t+1, which is what a drafter has to predict to propose the
next token. Only assistant tokens count (loss_mask). Two DataLoader workers read the store; with
--store-dtype fp8 the store takes half the disk and the dataset dequantizes each sample to bf16.
"""

import argparse
import itertools
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hscapture import open_store
from hscapture.dataset import CaptureDataset, pad_collate
from hscapture.extract import ExtractOptions, extract

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, default=Path("/tmp/hs-train"))
parser.add_argument("--store-dtype", choices=["fp8"], help="store rows as fp8 (default: as captured, bf16)")
parser.add_argument("--samples", type=int, default=64, help="demo conversations to extract")
parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
parser.add_argument("--batch", type=int, default=8)
args = parser.parse_args()

summary = extract(ExtractOptions(out=args.out, limit=args.samples, store_dtype=args.store_dtype, progress=False))
store = open_store(args.out)
stored = store.summary()
print(
    f"captured {summary.samples} samples; store {args.out}: {stored['complete']} samples, "
    f"rows stored as {store.store_dtype}, {stored['bytes']} bytes"
)

aux = [name for name in store.tensor_names if name != "last"]
dataset = CaptureDataset(args.out, tensors=[*aux, "last"])
loader = DataLoader(
    dataset,
    batch_size=args.batch,
    shuffle=True,
    num_workers=2,
    persistent_workers=True,
    collate_fn=pad_collate,
    generator=torch.Generator().manual_seed(0),
)
hidden = store.metadata()["hidden_size"]
torch.manual_seed(0)
head = torch.nn.Linear(len(aux) * hidden, hidden)
optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)

losses = []
batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
for step, batch in enumerate(itertools.islice(batches, args.steps)):
    fused = torch.cat([batch[name] for name in aux], dim=-1).float()[:, :-1]  # token t
    target = batch["last"].float()[:, 1:]  # token t + 1
    trained = (batch["attention_mask"][:, 1:] * batch["loss_mask"][:, 1:]).bool()
    loss = torch.nn.functional.smooth_l1_loss(head(fused)[trained], target[trained])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step % 10 == 0:
        print(f"step {step:3d}: loss {loss.item():.4f} over {int(trained.sum())} assistant tokens")
first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
print(
    f"trained {len(losses)} steps on {len(dataset)} samples: "
    f"mean loss of the first 5 steps {first:.4f}, last 5 {last:.4f}"
)
