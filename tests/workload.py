"""A deterministic stream of engine steps with a reference copy of every row, for pipeline tests.

Each step mixes new requests' prefill rows (first) with one decode row per running request,
as an engine's mixed batch does; states carry random padding rows that ``row_index`` skips.
Run as a script, it produces steps into an endpoint (a producer in another process).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hscapture import open_store
from hscapture.config import CaptureConfig
from hscapture.producer import Producer

HIDDEN = 32
LAYERS = (1, 3)
NUM_TENSORS = len(LAYERS) + 1


def make_config(
    endpoint: str, policy: str = "block", slots: int = 4, rows_per_slot: int = 8, device: str = "cpu"
) -> CaptureConfig:
    row_bytes = NUM_TENSORS * HIDDEN * 4
    return CaptureConfig(
        layers=LAYERS,
        hidden_size=HIDDEN,
        num_layers=4,
        dtype="float32",
        slot_bytes=rows_per_slot * row_bytes,
        ring_bytes=slots * rows_per_slot * row_bytes,
        max_step_rows=32,
        policy=policy,  # type: ignore[arg-type]
        endpoint=endpoint,
        block_timeout_s=60,
        device=device,
    )


def make_producer(config: CaptureConfig) -> Producer:
    return Producer(config, tensor_descriptions=[f"tensor {i}" for i in range(NUM_TENSORS)], meta={"engine": "test"})


@dataclass
class _Request:
    target: int
    rows: list[torch.Tensor] = field(default_factory=list)  # per position: [NUM_TENSORS, HIDDEN]
    tokens: list[int] = field(default_factory=list)
    #: Leading positions taken from a finished request (a prefix-cache hit): never forwarded, never sent.
    cached: int = 0


class Workload:
    """Steps of up to ``max_rows`` kept rows; ``reference(rid)`` returns what the store must hold.

    With ``share`` > 0 that share of new requests hits a prefix cache: it starts with the first
    positions (rows and tokens) of a finished request, sends only the rest, and names the cached
    tokens at its finish (``prefix_token_ids``), as the SGLang plugin does with the radix cache on.
    The store may take a prefix from any request holding the same tokens, as an engine's states
    are a function of the tokens: so then each forwarded token is a new id.
    """

    def __init__(
        self, seed: int, prefix: str = "r", max_rows: int = 32, device: str = "cpu", share: float = 0.0
    ) -> None:
        self.device = torch.device(device)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.prefix = prefix
        self.max_rows = max_rows
        self.share = share
        self._fresh = 1
        self.requests: dict[str, _Request] = {}
        self.running: list[str] = []
        self.finished: list[str] = []
        self.total_rows = 0
        self._next = 0

    def step(self, producer: Producer) -> int:
        """Produce one step (and finish requests that reached their length); returns rows announced."""
        ids, counts, positions, tokens, rows = [], [], [], [], []
        for rid in self.running:  # decode rows of running requests
            if sum(counts) + 1 > self.max_rows // 2:
                break
            self._add(rid, 1, ids, counts, positions, tokens, rows)
        while len(self.running) < 6 and self.rng.random() < 0.6:
            n = self.rng.randint(1, self.max_rows // 2 - 1)
            if sum(counts) + n > self.max_rows:
                break
            rid = f"{self.prefix}{self._next:05d}"
            self._next += 1
            request = self.requests[rid] = _Request(target=n + self.rng.randint(0, 6))
            if self.finished and self.rng.random() < self.share:
                donor = self.requests[self.rng.choice(self.finished)]
                request.cached = self.rng.randint(1, len(donor.rows))
                request.rows, request.tokens = donor.rows[: request.cached], donor.tokens[: request.cached]
                request.target += request.cached
            self.running.append(rid)
            ids.insert(0, rid)
            counts.insert(0, 0)
            self._add(rid, n, ids, counts, positions, tokens, rows, front=True)
        if not ids:
            return 0
        kept = torch.cat(rows, dim=1)  # [NUM_TENSORS, R, HIDDEN]
        pad = self.rng.randint(0, 3)
        padded = torch.randn(NUM_TENSORS, kept.shape[1] + pad, HIDDEN, generator=self.gen)
        order = torch.randperm(kept.shape[1] + pad, generator=self.gen)[: kept.shape[1]].sort().values
        padded[:, order] = kept
        states = list(padded.to(self.device))
        index = order.to(self.device) if pad else None
        announced = producer.capture_step(states, ids, counts, positions, tokens, row_index=index)
        if not pad:  # no padding: the states are the kept rows themselves
            assert torch.equal(padded, kept)
        self.total_rows += kept.shape[1]
        for rid in list(self.running):
            request = self.requests[rid]
            if len(request.rows) >= request.target:
                self.running.remove(rid)
                self.finished.append(rid)
                producer.finish_request(
                    rid,
                    num_tokens=len(request.rows),
                    loss_mask=[(1, len(request.rows))],
                    prefix_token_ids=request.tokens[: request.cached],
                )
        return announced

    def _add(
        self,
        rid: str,
        n: int,
        ids: list[str],
        counts: list[int],
        positions: list[int],
        tokens: list[int],
        rows: list[torch.Tensor],
        front: bool = False,
    ) -> None:
        request = self.requests[rid]
        start = len(request.rows)
        block = torch.randn(NUM_TENSORS, n, HIDDEN, generator=self.gen) + 1.0
        if self.share:  # every forwarded token new: equal token prefixes are copied ones, so their rows are equal
            toks = list(range(self._fresh, self._fresh + n))
            self._fresh += n
        else:
            toks = [self.rng.randrange(1, 50_000) for _ in range(n)]
        request.rows.extend(block[:, i] for i in range(n))
        request.tokens.extend(toks)
        if front:
            counts[0] = n
            positions[:0] = range(start, start + n)
            tokens[:0] = toks
            rows.insert(0, block)
        else:
            ids.append(rid)
            counts.append(n)
            positions.extend(range(start, start + n))
            tokens.extend(toks)
            rows.append(block)

    def reference(self, rid: str) -> tuple[torch.Tensor, list[int]]:
        """``[positions, NUM_TENSORS, HIDDEN]`` and token ids of everything produced for ``rid``."""
        request = self.requests[rid]
        return torch.stack(request.rows), request.tokens


def check_store(out: Path, workloads: list[Workload], keys: list[str] | None = None) -> dict[str, dict]:
    """Every stored row (``keys``: of these requests only) is bitwise the row produced at its position, with its token
    id; a complete request has every position and its loss mask. Returns the records by request id."""
    store = open_store(out)
    references = {rid: w for w in workloads for rid in w.requests}
    records = {}
    for rid in store.keys() if keys is None else keys:
        sample = store.get(rid)
        rows, tokens = references[rid].reference(rid)
        positions = sample["positions"]
        assert positions.unique().numel() == positions.numel(), f"{rid}: duplicate positions"
        stored = torch.stack([sample[name] for name in ("layer_1", "layer_3", "last")], dim=1)
        assert torch.equal(stored.view(torch.int32), rows[positions].view(torch.int32)), f"{rid}: rows differ"
        assert sample["input_ids"].tolist() == [tokens[p] for p in positions.tolist()], rid
        record = store.record(rid)
        if record["status"] == "complete":
            assert positions.tolist() == list(range(len(tokens))), rid
            assert sample["loss_mask"].tolist() == [0] + [1] * (len(tokens) - 1), rid
        records[rid] = record
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description="produce a test workload into an endpoint")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--prefix", default="p")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--step-s", type=float, default=0.01)
    args = parser.parse_args()
    producer = make_producer(make_config(args.endpoint, policy="drop"))
    while not producer.attached:  # steps printed before then would race the consumer's start-up
        producer.poll()
        time.sleep(0.01)
    workload = Workload(args.seed, args.prefix)
    for _ in range(args.steps):
        workload.step(producer)
        print("step", flush=True)
        time.sleep(args.step_s)
    producer.close()


if __name__ == "__main__":
    main()
