"""Training data: datasets, token-budget batches, anchors, block targets, resumable order.

Contract (docs/method.md#anchors-and-blocks):
- An epoch's order is a pure function of (seed, epoch): samples are shuffled, sorted by length inside
  windows (less padding), packed greedily under `--token-budget` (rows x padded length) and
  `--max-batch-size`, and the batch order is shuffled again. A data position is (epoch, batch index), so
  resuming replays exactly the batches an uninterrupted run would have seen.
- Anchors are redrawn every epoch from a generator keyed by (seed, epoch, sample id) — independent of how
  samples were packed — SORTED ascending and padded to a static N per row with keep=False (padded slots
  repeat the last real anchor so the row stays sorted; they see nothing and weigh nothing).
- A valid anchor p has loss_mask[p] = loss_mask[p+1] = 1. Block tokens are [x_p, MASK, ..., MASK] at
  positions p..p+B-1; slot k's label is x_{p+k} (same-position labels); its weight is w_k =
  exp(-(k-1)/gamma), and 0 on slot 0, past the sequence end, on unsupervised tokens and on padded anchors.
Everything here runs on the CPU (numpy); `Batch.to(device)` moves the tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np
import torch

from trainer.core.config import TrainConfig, TrainerInputError
from trainer.data.shards import Sample, ShardedDataset, ShardError

_ORDER_SALT = 0x5EED_0001  # keeps the order generator distinct from the anchor generators
_ANCHOR_SALT = 0x5EED_0002


@dataclass
class Batch:
    """One micro-batch. R rows padded to S context tokens, N anchors per row, B tokens per block."""

    input_ids: torch.Tensor  # int64 [R,S], padding = 0
    loss_mask: torch.Tensor  # bool [R,S]
    attention_mask: torch.Tensor  # int64 [R,S], 1 = real token
    anchors: torch.Tensor  # int64 [R,N], sorted ascending per row
    keep: torch.Tensor  # bool [R,N], False = padded anchor slot
    block_ids: torch.Tensor  # int64 [R,N*B]: [x_p, MASK, ...] per anchor
    labels: torch.Tensor  # int64 [R,N*B]: x_{p+k} (0 where invalid)
    weights: torch.Tensor  # float32 [R,N*B]: w_k * valid
    epoch: int  # data position of this micro-batch
    index: int
    num_ctx_tokens: int  # real (unpadded) context tokens
    num_blocks: int  # real anchors
    weight_sum: float  # weights.sum(), for the optimizer-step normaliser
    sample_ids: torch.Tensor | None = None  # int64 [R]: each row's dataset index, -1 for a padding row

    def to(self, device: torch.device | str) -> Batch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return Batch(**moved)


class SyntheticDataset:
    """In-memory token data with learnable structure, for the tiny preset (same interface as ShardedDataset).

    Each sample: a random prompt (loss mask 0) then an answer (mask 1) walked through a fixed sparse
    Markov chain over a small alphabet (each token has two successors, p = 0.8 / 0.2): low entropy, so a
    drafter's loss falls and its simulated acceptance rises within a few hundred steps.
    """

    def __init__(self, num_samples: int, vocab_size: int, max_len: int, seed: int, reserved: int) -> None:
        rng = np.random.default_rng([seed, 0xDA7A])
        usable = np.array([t for t in range(vocab_size) if t != reserved])
        alphabet = usable[: min(32, len(usable))]
        successors = rng.integers(0, len(alphabet), size=(len(alphabet), 2))
        self.samples: list[Sample] = []
        for _ in range(num_samples):
            prompt_len = int(rng.integers(4, max(5, max_len // 4)))
            length = int(rng.integers(max(prompt_len + 4, max_len // 2), max_len + 1))
            prompt = rng.choice(usable, size=prompt_len)
            state = int(rng.integers(len(alphabet)))
            answer = []
            for _ in range(length - prompt_len):
                answer.append(alphabet[state])
                state = int(successors[state, 0 if rng.random() < 0.8 else 1])
            ids = np.concatenate([prompt, np.array(answer)]).astype(np.int32)
            mask = np.concatenate([np.zeros(prompt_len), np.ones(length - prompt_len)]).astype(np.uint8)
            self.samples.append(Sample(ids, mask))
        self.lengths = np.array([len(s.input_ids) for s in self.samples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


def open_dataset(cfg: TrainConfig) -> ShardedDataset | SyntheticDataset:
    """The run's dataset; bad or missing data is a TrainerInputError (nothing has been written yet)."""
    if cfg.data_dir is None:
        assert cfg.vocab_size is not None and cfg.mask_token_id is not None
        return SyntheticDataset(cfg.synthetic_samples, cfg.vocab_size, cfg.max_seq_len, cfg.seed, cfg.mask_token_id)
    try:
        dataset = ShardedDataset(cfg.data_dir)
    except ShardError as exc:
        raise TrainerInputError(f"--data-dir: {exc}", hint="prepare data with `python -m trainer prepare`") from None
    meta_vocab = dataset.meta.vocab_size
    if cfg.vocab_size is not None and meta_vocab and meta_vocab > cfg.vocab_size:
        raise TrainerInputError(
            f"--data-dir: tokens come from a vocabulary of {meta_vocab} but the target has {cfg.vocab_size}",
            hint="prepare the data with the target's own tokenizer",
        )
    return dataset


def padded_length(length: int, max_seq_len: int) -> int:
    """Bucketed context length S: a multiple of max(128, max_seq_len // 8) (128 = flex_attention's tile),
    capped at max_seq_len — at most 8 context buckets, so compiled shapes stay few (docs/method.md#compiling)."""
    bucket = min(max(128, max_seq_len // 8), max_seq_len)
    return min(math.ceil(length / bucket) * bucket, max_seq_len)


def batch_shape(num_samples: int, longest: int, cfg: TrainConfig) -> tuple[int, int, int]:
    """Static (rows R, context S, anchors per row N) of a micro-batch: S is the bucket of its longest sample,
    R = max(samples, min(--max-batch-size, --token-budget // S)) — rows are padded up, so a bucket has one
    shape — and N = cfg.anchors_per_row(R). A function of the bucket alone, hence a handful of shapes."""
    seq = padded_length(min(longest, cfg.max_seq_len), cfg.max_seq_len)
    rows = max(num_samples, min(cfg.max_batch_size, cfg.token_budget // seq))
    return rows, seq, cfg.anchors_per_row(rows)


def epoch_batches(lengths: np.ndarray, epoch: int, cfg: TrainConfig) -> list[np.ndarray]:
    """The micro-batches of one epoch as arrays of sample ids; a pure function of (lengths, seed, epoch)."""
    rng = np.random.default_rng([cfg.seed, epoch, _ORDER_SALT])
    clipped = np.minimum(lengths, cfg.max_seq_len)
    order = rng.permutation(len(lengths))
    order = order[clipped[order] >= 2]  # a sample shorter than 2 tokens has no anchor
    window = cfg.max_batch_size * 32
    # Every sample's context bucket at once (padded_length, vectorised): the loop below is the per-sample cost
    # of a pre-flight and of every start (800K samples: 0.84 s an epoch with a padded_length call per sample).
    bucket = min(max(128, cfg.max_seq_len // 8), cfg.max_seq_len)
    padded = np.minimum(-(-clipped // bucket) * bucket, cfg.max_seq_len)
    batches: list[np.ndarray] = []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(clipped[chunk], kind="stable")]  # ascending: a sample's bucket is the longest
        current: list[int] = []
        for sample, seq in zip(chunk.tolist(), padded[chunk].tolist()):
            if current and (len(current) >= cfg.max_batch_size or (len(current) + 1) * seq > cfg.token_budget):
                batches.append(np.array(current, dtype=np.int64))
                current = []
            current.append(sample)
        if current:
            batches.append(np.array(current, dtype=np.int64))
    return [batches[i] for i in rng.permutation(len(batches))]


def sample_anchors(loss_mask: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `count` distinct valid anchors (mask[p] and mask[p+1]), sorted ascending."""
    valid = np.flatnonzero((loss_mask[:-1] > 0) & (loss_mask[1:] > 0))
    if len(valid) > count:
        valid = rng.choice(valid, size=count, replace=False)
    return np.sort(valid)


def collate(
    dataset: ShardedDataset | SyntheticDataset,
    sample_ids: np.ndarray,
    epoch: int,
    index: int,
    cfg: TrainConfig,
    slot_weights: np.ndarray,
) -> Batch:
    """Pad samples into a Batch and build its anchors, block ids, labels and weights (see module doc)."""
    assert cfg.mask_token_id is not None and cfg.vocab_size is not None
    samples = [dataset[int(i)] for i in sample_ids]
    lengths = [min(len(s.input_ids), cfg.max_seq_len) for s in samples]
    rows, seq, n_anchors = batch_shape(len(samples), max(lengths), cfg)
    block = cfg.block_size
    ids = np.zeros((rows, seq), np.int64)
    mask = np.zeros((rows, seq), np.bool_)
    # Padding rows (beyond the samples) attend over their pad ids: an all-zero attention row would give NaN
    # taps in the target; they have no anchors (keep=False) and no weight, so they cost compute, not results.
    attention = np.zeros((rows, seq), np.int64)
    attention[len(samples) :] = 1
    anchors = np.zeros((rows, n_anchors), np.int64)
    keep = np.zeros((rows, n_anchors), np.bool_)
    for r, (sample, length) in enumerate(zip(samples, lengths)):
        ids[r, :length] = sample.input_ids[:length]
        mask[r, :length] = sample.loss_mask[:length] > 0
        attention[r, :length] = 1
        rng = np.random.default_rng([cfg.seed, epoch, int(sample_ids[r]), _ANCHOR_SALT])
        chosen = sample_anchors(mask[r, :length], n_anchors, rng)
        anchors[r, : len(chosen)] = chosen
        anchors[r, len(chosen) :] = chosen[-1] if len(chosen) else 0
        keep[r, : len(chosen)] = True
    if ids.max(initial=0) >= cfg.vocab_size or ids.min(initial=0) < 0:
        bad = int(sample_ids[int(np.argmax((ids >= cfg.vocab_size).any(1) | (ids < 0).any(1)))])
        raise TrainerInputError(
            f"sample {bad} holds token ids outside the vocabulary (size {cfg.vocab_size})",
            hint="prepare the data with the target's own tokenizer",
        )
    # Block token (r, n, k) sits at position anchors[r,n] + k.
    positions = anchors[:, :, None] + np.arange(block)[None, None, :]  # [R,N,B]
    row_lengths = np.array(lengths + [0] * (rows - len(samples)))
    inside = positions < row_lengths[:, None, None]
    safe = np.minimum(positions, seq - 1)
    row = np.arange(rows)[:, None, None]
    labels = np.where(inside, ids[row, safe], 0)
    valid = inside & mask[row, safe] & keep[:, :, None]
    valid[:, :, 0] = False  # slot 0 is the anchor itself: never trained
    weights = (valid * slot_weights[None, None, :]).astype(np.float32)
    block_ids = np.full((rows, n_anchors, block), cfg.mask_token_id, np.int64)
    block_ids[:, :, 0] = ids[np.arange(rows)[:, None], anchors]
    return Batch(
        input_ids=torch.from_numpy(ids),
        loss_mask=torch.from_numpy(mask),
        attention_mask=torch.from_numpy(attention),
        anchors=torch.from_numpy(anchors),
        keep=torch.from_numpy(keep),
        block_ids=torch.from_numpy(block_ids.reshape(rows, -1)),
        labels=torch.from_numpy(labels.reshape(rows, -1)),
        weights=torch.from_numpy(weights.reshape(rows, -1)),
        epoch=epoch,
        index=index,
        num_ctx_tokens=int(sum(lengths)),
        num_blocks=int(keep.sum()),
        weight_sum=float(weights.sum(dtype=np.float64)),
        sample_ids=torch.tensor([int(i) for i in sample_ids] + [-1] * (rows - len(samples)), dtype=torch.long),
    )


class BatchStream:
    """Micro-batches in training order across epochs, starting at a data position (epoch, index)."""

    def __init__(
        self,
        dataset: ShardedDataset | SyntheticDataset,
        cfg: TrainConfig,
        slot_weights: np.ndarray,
        known_sizes: list[int] | None = None,
    ) -> None:
        """`known_sizes`: the first epochs' sizes as an earlier `epoch_sizes` call counted them (the pre-flight's)."""
        self.dataset, self.cfg, self.slot_weights = dataset, cfg, slot_weights
        self._batches: dict[int, list[np.ndarray]] = {}
        self._sizes: list[int] = list(known_sizes or [])

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._batches:
            self._batches = {epoch: epoch_batches(self.dataset.lengths, epoch, self.cfg)}  # keep one epoch only
        return self._batches[epoch]

    def epoch_sizes(self, enough: int | None = None) -> list[int]:
        """Micro-batches of epochs 0, 1, ...: of every epoch when `enough` is None, else of the first epochs that
        together hold at least `enough` micro-batches (all of them when they hold fewer). A run that ends at
        --max-steps never reads the epochs after those. Counting an epoch splits it into batches (O(samples),
        lengths only): 1.2 ms for 7,909 samples on the 2-core machine, so `--epochs 100000 --max-steps N` (the
        way to let --max-steps alone end a run) spent two minutes counting epochs it never reached when every
        epoch was counted. Counted once per stream, extended when asked for more."""
        total = sum(self._sizes)
        while len(self._sizes) < self.cfg.epochs and (enough is None or total < enough):
            self._sizes.append(len(epoch_batches(self.dataset.lengths, len(self._sizes), self.cfg)))
            total += self._sizes[-1]
        return list(self._sizes)

    def total_micro_batches(self, enough: int | None = None) -> int:
        """Micro-batches over all epochs, or over the first epochs that hold `enough` (`epoch_sizes`)."""
        return sum(self.epoch_sizes(enough))

    def iterate(self, epoch: int, index: int) -> Iterator[Batch]:
        """Yield batches from position (epoch, index) to the end of the last epoch."""
        while epoch < self.cfg.epochs:
            batches = self.epoch_batches(epoch)
            while index < len(batches):
                yield collate(self.dataset, batches[index], epoch, index, self.cfg, self.slot_weights)
                index += 1
            epoch, index = epoch + 1, 0
