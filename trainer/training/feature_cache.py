"""The offline feature cache (`train --feature-cache DIR`): each sample's target taps computed once and stored.

The target is frozen, so a sample's taps are the same in every epoch and every rerun; on the CPU the target's
forward is about half of a step of the real-model world (SmolLM2's 28 tapped layers against a 2-layer drafter), and
a run of ten epochs paid it ten times. With the cache, the first time a batch's every sample is seen its taps are
computed as before and each row's real positions `[:length]` written to `DIR/<key>/<sample>.npy`; a batch whose
every sample is cached is assembled from the files (padding positions and padding rows as zeros: the mask never lets
a block see them, so the loss is the same). SpecForge's offline mode stores hidden states the same way.

The key covers what the taps depend on: the target directory (path and its weight files' sizes and mtimes), the tap
layer ids, the dataset (its path, and what `prepare` made it from: prepare.json's fingerprint of the input and the
settings, and index.json's shards and their sizes), --max-seq-len and the taps' dtype; another key is another folder.
Not meta.json: `prepare` rewrites it on every run, with the path of the prompts file it was given, so a rerun that
found the dataset complete (`make demo-real`'s second run, its prompts written to a new work directory) changed the
key and filled the cache again from nothing. A dataset without prepare.json (written by other code) keys by its
meta.json and index.json.
Files are written under a temporary name and renamed, so a run killed mid-write leaves no half file. Cost on disk:
tokens x taps x hidden x 4 bytes in float32 (SmolLM2, 2 taps: 4.6 KB a token; the demo's 54k tokens: 248 MB).
Not for soft labels (they need the target's final hidden state) nor the threaded pipeline (its target workers run
ahead of the drafters; config.validate refuses both).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch


def cache_key(target_dir: str | Path, layer_ids: list[int], data_dir: str | Path, max_seq_len: int, dtype: str) -> str:
    from trainer.data.prepare import weight_files  # here, not at the top: every trainer start imports this module

    target, data = Path(target_dir).resolve(), Path(data_dir).resolve()
    weights = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weight_files(target)]
    text = json.dumps([str(target), weights, layer_ids, str(data), dataset_digest(data), max_seq_len, dtype])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dataset_digest(data: Path) -> str:
    """What a dataset's samples are made from (see the module doc): prepare.json (else meta.json) and index.json."""
    made_from = data / "prepare.json" if (data / "prepare.json").exists() else data / "meta.json"
    digest = hashlib.sha256()
    for path in (made_from, data / "index.json"):
        digest.update(path.read_bytes() if path.exists() else b"")
    return digest.hexdigest()


class FeatureCache:
    """Per-sample taps on disk under `root/key`. `load(batch_rows, lengths, seq)` or None; `store(...)`."""

    def __init__(self, root: str | Path, key: str, describe: dict[str, Any]) -> None:
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        about = self.dir / "key.json"
        if not about.exists():
            about.write_text(json.dumps(describe, indent=2) + "\n")
        self.hits = self.misses = 0

    def _path(self, sample: int) -> Path:
        return self.dir / f"{sample:08d}.npy"

    def load(self, samples: list[int], lengths: list[int], seq: int) -> torch.Tensor | None:
        """Taps [R, seq, T*H] for these rows (sample -1 = padding row), or None when any real row is missing."""
        arrays: list[np.ndarray | None] = []
        for sample in samples:
            if sample < 0:
                arrays.append(None)
                continue
            try:
                arrays.append(np.load(self._path(sample)))
            except (FileNotFoundError, ValueError, OSError):  # missing, or cut by a kill before the rename
                self.misses += 1
                return None
        width = next(a.shape[1] for a in arrays if a is not None)
        dtype = next(a.dtype for a in arrays if a is not None)
        taps = np.zeros((len(samples), seq, width), dtype=dtype)
        for row, (array, length) in enumerate(zip(arrays, lengths)):
            if array is not None:
                if array.shape[0] != length:
                    self.misses += 1
                    return None
                taps[row, :length] = array
        self.hits += 1
        return torch.from_numpy(taps)

    def store(self, samples: list[int], lengths: list[int], taps: torch.Tensor) -> None:
        host = taps.detach().to("cpu")
        if host.dtype == torch.bfloat16:  # numpy has no bfloat16: keep it as float32 (exact)
            host = host.float()
        for row, (sample, length) in enumerate(zip(samples, lengths)):
            if sample < 0:
                continue
            final = self._path(sample)
            tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as handle:
                np.save(handle, host[row, :length].numpy())
            os.replace(tmp, final)


def open_feature_cache(cfg: Any, target: Any) -> FeatureCache | None:
    """The cache `--feature-cache DIR` names for this target, taps and dataset, or None (off)."""
    if not cfg.feature_cache or cfg.feature_cache == "off":
        return None
    dtype = str(target.embed_weight.dtype).removeprefix("torch.")
    key = cache_key(cfg.target_model, target.layer_ids, cfg.data_dir, cfg.max_seq_len, dtype)
    describe = {"target_model": cfg.target_model, "layer_ids": target.layer_ids, "data_dir": cfg.data_dir}
    cache = FeatureCache(cfg.feature_cache, key, {**describe, "max_seq_len": cfg.max_seq_len, "dtype": dtype})
    print(f"feature cache: {cache.dir} (--feature-cache)", file=sys.stderr, flush=True)
    return cache
