"""The drafter trainers' own data loading, run over an export: SpecForge 0.2.0 and speculators 0.9.0.

Nothing here re-implements a trainer. Each function wires the installed package's loader the
way that trainer's entry point does (named in each docstring) and returns what the trainer
would train on, so a test comparing it with the store proves the trainer reads our files.
The packages come from their wheels with ``pip install --no-deps specforge==0.2.0
speculators==0.9.0 hs-connectors==0.9.0`` (``.ci/run``): their data modules import with torch,
transformers, datasets and openai, without SGLang or vLLM. Tests call :func:`require` first, so
they skip, naming the command, where a package is missing; with ``HSCAPTURE_TEST_TRAINERS=required``
(CI) they fail instead.
"""

from __future__ import annotations

import importlib.util
import os
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch

#: Package (import name) -> the distribution and version the tests were written against.
TRAINERS = {
    "specforge": "specforge==0.2.0",
    "speculators": "speculators==0.9.0",
    "hs_connectors": "hs-connectors==0.9.0",
}
#: SpecForge's default test-time-training length (``--ttt-length``); the offline normalizer ignores it.
SPECFORGE_TTT_LENGTH = 7


def require(*packages: str) -> None:
    """Skip (or fail, where CI requires the trainers) the calling test unless every named package imports."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        pins = " ".join(TRAINERS[name] for name in packages)
        message = f"{', '.join(missing)} not installed: pip install --no-deps {pins}"
        if os.environ.get("HSCAPTURE_TEST_TRAINERS") == "required":
            pytest.fail(f"HSCAPTURE_TEST_TRAINERS=required, but {message}")
        pytest.skip(message)


def specforge_batches(export_dir: Path, max_len: int, batch_size: int) -> list[tuple[list[Path], dict[str, Any]]]:
    """Every batch SpecForge's colocated offline EAGLE-3 training reads from ``export_dir``, with its files.

    ``specforge/launch.py:build_offline_runtime``: the EAGLE-3 registration's offline provider
    builds the ``OfflineManifestReader`` (one ``file://`` ref per ``.ckpt``), the normalizer
    (``normalize_offline_sample``) and the collator (``DataCollatorWithPadding``); a
    ``LocalFeatureStore`` serves the refs to a ``FeatureDataLoader``. Refs stay in the reader's
    order (the runtime shuffles them per epoch; the bytes of each sample do not change).
    """
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane import FeatureDataLoader, LocalFeatureStore

    algorithm = builtin_algorithm_registry().resolve("eagle3")
    provider = algorithm.providers.offline_for("text")
    refs = provider.build_reader(
        str(export_dir), run_id="hscapture", ttt_length=SPECFORGE_TTT_LENGTH, max_len=max_len
    ).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("hscapture"),
        refs=refs,
        batch_size=batch_size,
        collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(
            max_len, ttt_length=SPECFORGE_TTT_LENGTH, use_usp_preprocess=False
        ),
        drop_last=False,
        strategy=algorithm.name,
    )
    files = {ref.sample_id: Path(ref.feature_store_uri.removeprefix("file://")) for ref in refs}
    return [([files[sample_id] for sample_id in batch.sample_ids], batch.tensors) for batch in loader]


def specforge_legacy_items(export_dir: Path, max_len: int) -> list[tuple[Path, dict[str, torch.Tensor]]]:
    """SpecForge's older ``OfflineEagle3Dataset`` over ``list_local_files`` (its sequence-parallel path now)."""
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files

    files = list_local_files(str(export_dir))
    dataset = OfflineEagle3Dataset(files, max_len=max_len)
    return [(Path(path), dataset[i]) for i, path in enumerate(files)]


def _speculators_transfer(export_dir: Path) -> Any:
    """The hs-connectors file backend as ``speculators train`` builds it (``--hidden-states-path`` unset)."""
    from hs_connectors import HiddenStatesBackend

    return HiddenStatesBackend.registry["file"].from_train_args(Namespace(hidden_states_path=None), str(export_dir))


def speculators_dataset(export_dir: Path, max_len: int) -> Any:
    """speculators' ``ArrowDataset`` over ``export_dir`` with the hs-connectors file transfer.

    ``on_missing="raise"``: a sample without its hidden states fails instead of asking a vLLM
    server to generate them.
    """
    from speculators.train.data import ArrowDataset

    return ArrowDataset(
        max_len=max_len, datapath=str(export_dir), transfer=_speculators_transfer(export_dir), on_missing="raise"
    )


def speculators_eagle3_loaders(
    export_dir: Path, total_seq_len: int, hidden_size: int, num_target_layers: int, train_ratio: float
) -> tuple[Any, Any]:
    """The train and validation loaders ``speculators train --speculator-type eagle3`` builds.

    ``speculators/train/cli.py``: ``create_train_val_loaders`` with EAGLE-3's ``shift_batch`` as
    the preprocess step: packing by length (``MultipackDistributedBatchSamplerV2``), the shift,
    ``CollateFn`` packing each batch into one ``[1, total_seq_len, ...]`` row. No workers (the
    trainer spawns some; the data path is the same).
    """
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    return create_train_val_loaders(
        data_path=str(export_dir),
        total_seq_len=total_seq_len,
        hidden_states_dtype=torch.bfloat16,
        transfer=_speculators_transfer(export_dir),
        vllm_endpoint="http://127.0.0.1:1/v1",  # never called: every sample's hidden states are on disk
        on_missing="raise",
        verifier_name_or_path="hscapture-tiny",
        request_timeout=None,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=hidden_size,
        num_target_layers=num_target_layers,
        num_workers=0,
        prefetch_factor=1,
        preprocess=shift_batch,
        train_data_ratio=train_ratio,
    )
