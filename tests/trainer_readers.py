"""How the two drafter trainers read their training files, re-implemented to load our exports.

Each function follows the named upstream code step for step (same calls, same slicing, same
checks), written out here because neither trainer can be installed in the test environment.
Nothing else of theirs is reproduced.

* SpecForge, sgl-project/SpecForge @ a6b6b0230009d15ec2a97a57384e6f53f0f96946,
  ``specforge/data/preprocessing.py``: ``list_local_files``, ``OfflineEagle3Dataset._open_file``
  and ``OfflineEagle3Dataset.process_data`` (the non-sequence-parallel path).
* speculators, vllm-project/speculators @ c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b,
  ``src/speculators/train/data.py`` (``ArrowDataset.__init__``/``_compute_approx_lengths``/
  ``_get_raw_data``, ``BaseDataset.__getitem__``) and ``hs_connectors/src/hs_connectors/transfer.py``
  (``FileTransfer.get_cached``, ``_load_hs_file``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def specforge_list_files(path: str | Path) -> list[str]:
    """Every ``.ckpt``/``.ckpt.gz`` below ``path`` (walked recursively), sorted as strings."""
    found = []
    for root, _dirs, files in os.walk(path):
        found += [os.path.join(root, name) for name in files]
    found = [name for name in found if name.endswith((".ckpt", ".ckpt.gz"))]
    found.sort()
    return found


def specforge_item(path: str, max_len: int = 2048) -> dict[str, torch.Tensor]:
    """``OfflineEagle3Dataset.__getitem__`` for one file: memory-mapped load, then process_data."""
    data = torch.load(path, weights_only=False, mmap=True)
    item = {
        "hidden_state": data["aux_hidden_state"].squeeze(0)[:max_len][None, :],  # the drafter's input
        "target": data["hidden_state"].squeeze(0)[:max_len][None, :],  # the target model's final state
        "input_ids": data["input_ids"][:max_len][None, :],
        "loss_mask": data["loss_mask"][:max_len][None, :],
    }
    item["loss_mask"][0, -1] = 0  # upstream zeroes the last position in place
    item["attention_mask"] = torch.ones_like(item["loss_mask"], dtype=torch.long)
    return item


class SpeculatorsDataset:
    """``ArrowDataset`` with the file transfer, on hidden states already cached (``on_missing='raise'``)."""

    def __init__(self, datapath: str | Path) -> None:
        from datasets import load_from_disk

        self.data = load_from_disk(str(datapath))
        self.hidden_states_path = Path(datapath) / "hidden_states"
        self.approx_lengths = list(self.data.with_format(None)["seq_len"])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        path = self.hidden_states_path / f"hs_{index}.safetensors"
        if Path(str(path) + ".lock").exists():
            raise AssertionError(f"{path}: a .lock beside it would make speculators wait for a writer")
        if not path.exists():
            raise RuntimeError(f"Failed to load hidden states for sample {index}.")
        loaded = load_file(path)
        if not torch.equal(loaded["token_ids"], self.data[index]["input_ids"]):
            return None  # upstream warns and skips the sample
        data = {
            "hidden_states": loaded["hidden_states"][:, :-1].flatten(1),  # [seq, aux * hidden]
            "input_ids": loaded["token_ids"],
            "verifier_last_hidden_states": loaded["hidden_states"][:, -1],  # [seq, hidden]
            "loss_mask": self.data[index]["loss_mask"],
        }
        seq_len = data["input_ids"].shape[0]
        data["lengths"] = torch.tensor([seq_len], dtype=torch.long)
        data["position_ids"] = torch.arange(seq_len, dtype=torch.long)
        return data
