"""The token-shard format: the contract between `trainer prepare` (writer) and `trainer train` (reader).

A dataset directory holds:

    meta.json                 dataset metadata (see `DatasetMeta`); written last, so its presence means
                              "every shard listed in index.json is complete"
    index.json                {"format": 1, "shards": [{"name": "shard-00000", "num_samples": n,
                               "num_tokens": t}, ...]}
    shard-00000.tokens.npy    int32 [num_tokens]      all samples' input ids, concatenated
    shard-00000.mask.npy      uint8 [num_tokens]      loss mask (1 = supervised answer token)
    shard-00000.offsets.npy   int64 [num_samples + 1] sample i is tokens[offsets[i]:offsets[i+1]]

Every `.npy` is written to a temporary name and renamed, so a shard is either complete or absent; readers
open them with `mmap_mode="r"` (no copy; the OS pages in what a batch touches).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1


class ShardError(ValueError):
    """A dataset directory that is missing, empty or inconsistent. The message names the file."""


@dataclass
class DatasetMeta:
    """What produced the tokens. `train` checks chat template and thinking mode against its own settings."""

    tokenizer: str = ""
    chat_template_sha256: str = ""
    enable_thinking: bool | None = None
    regenerated: bool = False
    vocab_size: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        np.save(handle, array)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _atomic_write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_shard(
    directory: Path, name: str, samples: Sequence[tuple[list[int] | np.ndarray, list[int] | np.ndarray]]
) -> dict:
    """Write one shard (ids and mask per sample) atomically; return its index entry."""
    lengths = [len(ids) for ids, _ in samples]
    for i, (ids, mask) in enumerate(samples):
        if len(ids) != len(mask):
            raise ShardError(f"{name}: sample {i} has {len(ids)} ids but {len(mask)} mask values")
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = (
        np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in samples]) if samples else np.zeros(0, np.int32)
    )
    mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in samples]) if samples else np.zeros(0, np.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    # offsets last: a shard whose offsets file exists has its tokens and mask on disk.
    _atomic_save(directory / f"{name}.tokens.npy", tokens)
    _atomic_save(directory / f"{name}.mask.npy", mask)
    _atomic_save(directory / f"{name}.offsets.npy", offsets)
    return {"name": name, "num_samples": len(samples), "num_tokens": int(offsets[-1])}


def write_index(directory: Path, entries: list[dict], meta: DatasetMeta) -> None:
    """Write index.json then meta.json (meta last: its presence marks the dataset complete)."""
    meta.num_samples = sum(e["num_samples"] for e in entries)
    meta.num_tokens = sum(e["num_tokens"] for e in entries)
    _atomic_write_json(directory / "index.json", {"format": FORMAT_VERSION, "shards": entries})
    _atomic_write_json(directory / "meta.json", asdict(meta))


def read_meta(directory: Path) -> DatasetMeta:
    path = Path(directory) / "meta.json"
    if not Path(directory).is_dir():
        raise ShardError(f"data directory {directory} does not exist")
    if not path.exists():
        raise ShardError(f"{path} is missing: {directory} is not a prepared dataset (run `python -m trainer prepare`)")
    raw = json.loads(path.read_text())
    known = {k: raw.pop(k) for k in list(raw) if k in DatasetMeta.__dataclass_fields__}
    return DatasetMeta(**known)


class ShardedDataset:
    """Random access to samples across memory-mapped shards. `len(ds)`, `ds[i] -> Sample`, `ds.length(i)`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        index = json.loads((self.directory / "index.json").read_text())
        if index.get("format") != FORMAT_VERSION:
            raise ShardError(f"{self.directory}/index.json: format {index.get('format')} (expected {FORMAT_VERSION})")
        self._tokens: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        for entry in index["shards"]:
            base = self.directory / entry["name"]
            try:
                tokens = np.load(f"{base}.tokens.npy", mmap_mode="r")
                mask = np.load(f"{base}.mask.npy", mmap_mode="r")
                offsets = np.load(f"{base}.offsets.npy", mmap_mode="r")
            except FileNotFoundError as exc:
                raise ShardError(f"shard file missing: {exc.filename}") from None
            if len(tokens) != len(mask) or int(offsets[-1]) != len(tokens):
                raise ShardError(
                    f"{base}: {len(tokens)} ids, {len(mask)} mask values, offsets end at {int(offsets[-1])} (must agree)"
                )
            self._tokens.append(tokens)
            self._mask.append(mask)
            self._offsets.append(offsets)
        counts = [len(o) - 1 for o in self._offsets]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self._starts[-1] == 0:
            raise ShardError(f"data directory {self.directory} holds no samples")
        # Lengths of every sample, for token-budget batching without touching token pages.
        self.lengths = np.concatenate([np.diff(o) for o in self._offsets]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self._starts, index, side="right") - 1)
        return shard, index - int(self._starts[shard])

    def __getitem__(self, index: int) -> Sample:
        shard, local = self._locate(index)
        lo, hi = int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        return Sample(np.asarray(self._tokens[shard][lo:hi]), np.asarray(self._mask[shard][lo:hi]))
