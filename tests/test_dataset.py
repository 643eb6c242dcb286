"""CaptureDataset and pad_collate over stores made by real extractions of the tiny model, through real
DataLoader worker processes (fork and spawn), and the memory one item costs, measured in /proc."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from hscapture import open_store
from hscapture.dataset import CaptureDataset, pad_collate
from hscapture.store.records import Finish
from hscapture.store.writer import StoreWriter
from tests.storefeed import make_layout, write_rows

AUX = ["layer_2", "layer_4", "layer_5"]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (what, name)
        same = torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))  # bit for bit, NaN included
        assert same, (what, name)


def unpad(batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    n = int(batch["attention_mask"][row].sum())
    assert batch["attention_mask"][row, :n].all() and not batch["attention_mask"][row, n:].any()
    return {name: value[row, :n] for name, value in batch.items() if name != "attention_mask"}


@pytest.mark.parametrize("which", ["tiny_store", "tiny_store_fp8"])
def test_two_forked_workers_return_exactly_the_stored_samples(which: str, request: pytest.FixtureRequest) -> None:
    root: Path = request.getfixturevalue(which)
    store = open_store(root)
    dataset = CaptureDataset(root)
    assert dataset.keys == store.keys(complete_only=True) and len(dataset) == len(store)
    dataset[0]  # the parent maps a shard first: the workers must not read through that mapping
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    seen = 0
    for key, sample in zip(dataset.keys, loader, strict=True):
        assert_same(sample, store.get(key), key)
        assert sample["layer_2"].dtype == torch.bfloat16
        seen += 1
    assert seen == len(store)


def test_spawned_workers_and_pad_collate_batches(tiny_store_fp8: Path) -> None:
    """The dataset pickles (spawn), raw fp8 codes and scales pad like everything else."""
    store = open_store(tiny_store_fp8)
    dataset = CaptureDataset(tiny_store_fp8, tensors=["last", "layer_2"], dequantize=False)
    collate = functools.partial(pad_collate, pad_token_id=-7)
    loader = DataLoader(dataset, batch_size=5, num_workers=2, multiprocessing_context="spawn", collate_fn=collate)
    keys = iter(dataset.keys)
    for batch in loader:
        assert batch["last"].dtype == torch.float8_e4m3fn and batch["last.scale"].dtype == torch.float32
        longest = batch["attention_mask"].shape[1]
        for row in range(batch["input_ids"].shape[0]):
            key = next(keys)
            assert_same(unpad(batch, row), store.get(key, tensors=["last", "layer_2"], dequantize=False), key)
            n = int(batch["attention_mask"][row].sum())
            assert (batch["input_ids"][row, n:] == -7).all() and not batch["loss_mask"][row, n:].any()
            assert batch["last"][row, n:].float().abs().sum() == 0
        assert longest == max(int(m.sum()) for m in batch["attention_mask"])
    assert next(keys, None) is None


def test_each_forked_worker_maps_the_shards_itself(tiny_store: Path) -> None:
    dataset = CaptureDataset(tiny_store, tensors=["last"])
    dataset[0]
    parent = (os.getpid(), dataset.store._pid)

    def collate(samples: list[dict[str, torch.Tensor]]) -> tuple[int, int]:  # runs in the worker
        return os.getpid(), dataset.store._pid

    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork", collate_fn=collate)
    workers = set(loader)
    assert parent[0] == parent[1] and len(workers) == 2
    for worker_pid, mapped_by in workers:
        assert worker_pid != parent[0] and mapped_by == worker_pid


def test_subsets_and_clear_errors(tiny_store: Path) -> None:
    store = open_store(tiny_store)
    keys = store.keys()[3:6][::-1]
    dataset = CaptureDataset(tiny_store, tensors=AUX, keys=keys)
    assert len(dataset) == 3
    assert_same(dataset[1], store.get(keys[1], tensors=AUX), keys[1])
    assert "last" not in dataset[0]
    with pytest.raises(KeyError, match=r"tensors: \['layer_3'\] are not in .* it holds \['layer_2'"):
        CaptureDataset(tiny_store, tensors=["layer_3"])
    with pytest.raises(KeyError, match=r"keys: \['nope'\] \(1 in all\) are not complete requests"):
        CaptureDataset(tiny_store, keys=["nope"])
    with pytest.raises(ValueError, match="samples: nothing to collate"):
        pad_collate([])


# ------------------------------------------------------------------------------ memory

HIDDEN = 4096
NAMES = ["layer_2", "last"]
ROWS_PER_REQUEST = 32  # 32 rows x 2 tensors x 4096 x bf16 = 512 KiB per sample
SHARD_BYTES = 128 << 20


def write_one_big_shard(root: Path) -> int:
    """One 128 MiB bf16 shard of 256 requests; returns the number of requests."""
    rng = np.random.default_rng(0)
    writer = StoreWriter(root, SHARD_BYTES + (1 << 20))
    writer.begin_run(*make_layout(dtype="bfloat16", hidden=HIDDEN, names=NAMES, descriptions=NAMES))
    count = SHARD_BYTES // (ROWS_PER_REQUEST * len(NAMES) * HIDDEN * 2)
    for r in range(count):
        rows = torch.from_numpy(rng.standard_normal((len(NAMES), ROWS_PER_REQUEST, HIDDEN), dtype=np.float32))
        positions = np.arange(ROWS_PER_REQUEST)
        write_rows(writer, rows.bfloat16(), [f"r{r}"], [ROWS_PER_REQUEST], positions, positions)
        writer.finish_request(f"r{r}", Finish("finished", num_tokens=ROWS_PER_REQUEST))
    writer.close()
    return count


def resident_kib() -> int:
    """This process's resident memory: anonymous (copies) plus file pages mapped in (shard reads)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["RssAnon"].split()[0]) + int(fields["RssFile"].split()[0])


def test_an_item_maps_and_copies_its_rows_not_the_shard(tmp_path: Path) -> None:
    """Resident memory grows by about the item, far from the 128 MiB shard it sits in; a whole-shard
    copy (every tensor of safetensors ``load_file``) in the same process grows it by the shard: the
    measure can tell.

    File pages are mapped in folios (up to 2 MiB each on this kernel), so an item touching four
    places (positions, token ids, two tensors) maps up to ~8 MiB; the bound leaves room for that.
    """
    count = write_one_big_shard(tmp_path)
    (shard,) = tmp_path.glob("shard-*.safetensors")
    assert shard.stat().st_size > SHARD_BYTES
    dataset = CaptureDataset(tmp_path)
    sample_kib = sum(t.numel() * t.element_size() for t in dataset[0].values()) // 1024  # warms up the mapping
    assert 512 <= sample_kib < 600
    growth = []
    for index in (count // 2, count - 1):
        before = resident_kib()
        item = dataset[index]
        growth.append(resident_kib() - before)
        assert item["last"].shape == (ROWS_PER_REQUEST, HIDDEN)
    print(f"\nitem {sample_kib} KiB from a {shard.stat().st_size >> 20} MiB shard: resident +{growth} KiB")
    assert max(growth) < 16 << 10, f"an item grew resident memory by {growth} KiB: it read much of the shard"

    before = resident_kib()
    whole = torch.cat([tensor.reshape(-1).view(torch.uint8) for tensor in load_file(shard).values()])
    assert resident_kib() - before > (SHARD_BYTES >> 10) * 0.9, "the control must show a whole-shard read"
    del whole
