"""Training on a store: a ``torch.utils.data.Dataset`` of captured samples, and a padding collate.

Each item is one request, read with :meth:`hscapture.store.reader.Store.get`: the shards are memory-mapped
(safetensors ``safe_open``) and ``get_slice`` copies out only the item's rows, so an item costs its
own bytes, never a whole shard (``tests/test_dataset.py`` measures it). The dataset pickles without
any mapping, and a forked DataLoader worker drops the mappings it inherited, so every worker maps
the shards it reads itself, lazily; no file handle or mapping is shared between processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from hscapture.store.collection import open_store

Sample = dict[str, torch.Tensor]


class CaptureDataset(Dataset[Sample]):
    """The requests of a store as training samples, in the order they were written.

    Args:
        store_dir: the store directory, a directory of parts (``extract --shard``/``--data-parallel``,
            ``serve``'s ``dp<rank>``) or a list of stores: a set serves each key once, part by part
            (:class:`~hscapture.store.collection.StoreSet`).
        tensors: the captured tensors to return (default: all, e.g. ``layer_2``, ..., ``last``).
        complete_only: leave out requests recorded as incomplete (dropped rows, aborted, ...).
        keys: the request ids to serve, in this order (default: every one, or every complete one).
        dequantize: on an fp8 store, return rows in the captured dtype (default); False gives the
            float8_e4m3fn codes plus ``{name}.scale`` per row, for dequantizing on the GPU.
        max_open_shards: shard mappings each process keeps open.
        verify: check every row served against the checksum written with it (the default; a damaged
            row raises :class:`~hscapture.errors.StoreError` naming the shard and the request). False
            skips the CRC-32s (``benchmarks/read_verify.py`` measures what they cost).

    Each item: ``input_ids``, ``positions``, ``loss_mask`` (int64 ``[seq]``) and each requested
    tensor ``[seq, hidden]``, rows sorted by position. A sample captured at some positions only
    (``hscapture extract --positions loss|last|every:K``) yields the rows it holds, ``seq`` of them,
    with their position ids in ``positions`` (not ``0..seq-1``) and their own token ids; it is complete
    when it holds every position it asked for.

    Raises:
        StoreError: not a store, or a damaged one. KeyError: a tensor or key the store does not hold (or
            holds incomplete).
    """

    def __init__(
        self,
        store_dir: str | Path | Sequence[str | Path],
        tensors: Sequence[str] | None = None,
        complete_only: bool = True,
        keys: Sequence[str] | None = None,
        dequantize: bool = True,
        max_open_shards: int = 16,
        verify: bool = True,
    ) -> None:
        self.store = open_store(store_dir, max_open_shards=max_open_shards, verify=verify)
        self.tensors = list(self.store.tensor_names if tensors is None else tensors)
        unknown = [name for name in self.tensors if name not in self.store.tensor_names]
        if unknown:
            raise KeyError(f"tensors: {unknown} are not in {self.store.root}; it holds {self.store.tensor_names}")
        servable = self.store.keys(complete_only=complete_only)
        if keys is None:
            self.keys = servable
        else:
            allowed = set(servable)
            absent = [key for key in keys if key not in allowed]
            if absent:
                what = "complete requests" if complete_only else "requests"
                raise KeyError(
                    f"keys: {absent[:5]} ({len(absent)} in all) are not {what} of {self.store.root}"
                    + ("; pass complete_only=False to read incomplete ones" if complete_only else "")
                )
            self.keys = list(keys)
        self.dequantize = dequantize

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> Sample:
        return self.store.get(self.keys[index], self.tensors, dequantize=self.dequantize)


def pad_collate(samples: Sequence[Sample], pad_token_id: int = 0) -> Sample:
    """Stack variable-length samples into a batch, right-padded to the longest.

    Every field becomes ``[batch, max_seq, ...]``: ``input_ids`` padded with ``pad_token_id``,
    everything else (loss mask, positions, hidden states, fp8 codes and scales) with zeros; plus
    ``attention_mask`` int64 ``[batch, max_seq]``, 1 on real rows. Use it as a DataLoader's
    ``collate_fn`` (``functools.partial`` to set ``pad_token_id``).
    """
    if not samples:
        raise ValueError("samples: nothing to collate")
    lengths = torch.tensor([len(sample["input_ids"]) for sample in samples])
    batch = {
        name: pad_sequence(
            [sample[name] for sample in samples],
            batch_first=True,
            padding_value=pad_token_id if name == "input_ids" else 0,
        )
        for name in samples[0]
    }
    batch["attention_mask"] = (torch.arange(int(lengths.max())) < lengths[:, None]).long()
    return batch
