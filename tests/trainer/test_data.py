"""trainer.data.batches: deterministic token-budget batches, sorted per-epoch anchors, block targets, bad shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainer.core.config import TrainConfig, TrainerInputError, parse_train_args
from trainer.data.batches import BatchStream, batch_shape, collate, epoch_batches, open_dataset, padded_length
from trainer.data.shards import DatasetMeta, write_index, write_shard
from trainer.training.loss import position_weights

MASK = 255


def _cfg(tmp_path: Path, *extra: str):
    return parse_train_args(["--preset", "tiny", "--output-dir", str(tmp_path / "run"), *extra])


def _write_dataset(
    directory: Path, lengths: list[int], seed: int = 0, vocab: int = 200, meta_vocab: int = 256
) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    samples = []
    for length in lengths:
        ids = rng.integers(0, vocab, size=length)
        mask = (rng.random(length) < 0.7).astype(np.uint8)
        mask[: length // 4] = 0  # a prompt
        samples.append((ids, mask))
    entries = [
        write_shard(directory, "shard-00000", samples[: len(samples) // 2]),
        write_shard(directory, "shard-00001", samples[len(samples) // 2 :]),
    ]
    write_index(directory, entries, DatasetMeta(vocab_size=meta_vocab))
    return samples


def test_epoch_batches_are_deterministic_complete_and_within_budget(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--token-budget", "200", "--max-batch-size", "3")
    lengths = np.random.default_rng(1).integers(1, 90, size=100)
    epoch0 = epoch_batches(lengths, 0, cfg)
    assert [b.tolist() for b in epoch0] == [b.tolist() for b in epoch_batches(lengths, 0, cfg)]
    assert [b.tolist() for b in epoch0] != [b.tolist() for b in epoch_batches(lengths, 1, cfg)]
    used = np.concatenate(epoch0)
    assert sorted(used.tolist()) == sorted(np.flatnonzero(lengths >= 2).tolist())  # each sample once
    for batch in epoch0:
        longest = min(int(lengths[batch].max()), cfg.max_seq_len)
        assert len(batch) <= 3 and len(batch) * padded_length(longest, cfg.max_seq_len) <= 200


def test_collate_builds_sorted_anchors_and_same_position_targets(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    samples = _write_dataset(data_dir, [40, 64, 90, 12, 3])
    cfg = _cfg(
        tmp_path,
        "--data-dir",
        str(data_dir),
        "--anchors-per-seq",
        "6",
        "--max-anchors",
        "30",
        "--block-size",
        "4",
        "--gamma",
        "2",
    )
    dataset = open_dataset(cfg)
    slot_w = position_weights(4, 2.0).numpy()
    ids = np.array([0, 1, 2, 3, 4])
    batch = collate(dataset, ids, 3, 7, cfg, slot_w)
    R, N, B = 5, cfg.anchors_per_row(5), 4
    assert batch.anchors.shape == (R, N) and batch.block_ids.shape == (R, N * B) and batch.input_ids.shape[1] == 64
    for r, sample_id in enumerate(ids):
        tokens, mask = samples[sample_id]
        length = min(len(tokens), cfg.max_seq_len)
        anchors, keep = batch.anchors[r].tolist(), batch.keep[r].tolist()
        real = [a for a, k in zip(anchors, keep) if k]
        assert keep == sorted(keep, reverse=True)  # real anchors first, padding after
        assert anchors == sorted(anchors) and len(set(real)) == len(real)
        valid = [p for p in range(length - 1) if mask[p] and mask[p + 1]]
        assert len(real) == min(N, len(valid)) and set(real) <= set(valid)
        for n, (anchor, kept) in enumerate(zip(anchors, keep)):
            for k in range(B):
                col, pos = n * B + k, anchor + k
                assert batch.block_ids[r, col] == (tokens[anchor] if k == 0 else MASK) or not kept
                supervised = kept and k >= 1 and pos < length and bool(mask[pos])
                expected_w = slot_w[k] if supervised else 0.0
                assert batch.weights[r, col].item() == pytest.approx(expected_w)
                if supervised:
                    assert batch.labels[r, col] == tokens[pos]  # same-position label x_{p+k}
    assert batch.num_blocks == int(batch.keep.sum()) and batch.weight_sum == pytest.approx(float(batch.weights.sum()))
    assert (batch.epoch, batch.index) == (3, 7)


def test_anchors_are_redrawn_each_epoch_but_fixed_per_epoch(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--anchors-per-seq", "4")
    dataset = open_dataset(cfg)  # synthetic tiny data: long supervised answers
    slot_w = position_weights(cfg.block_size, cfg.gamma).numpy()
    ids = np.array([5, 9])
    a0 = collate(dataset, ids, 0, 0, cfg, slot_w).anchors
    assert collate(dataset, ids, 0, 3, cfg, slot_w).anchors.equal(a0)  # independent of the batch position
    assert not collate(dataset, ids, 1, 0, cfg, slot_w).anchors.equal(a0)


def test_stream_resumes_at_a_data_position(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--epochs", "2", "--synthetic-samples", "24")
    stream = BatchStream(open_dataset(cfg), cfg, position_weights(cfg.block_size, cfg.gamma).numpy())
    full = [(b.epoch, b.index, b.input_ids) for b in stream.iterate(0, 0)]
    assert len(full) == stream.total_micro_batches() and {e for e, _, _ in full} == {0, 1}
    start = len(full) // 2 + 1
    tail = [(b.epoch, b.index, b.input_ids) for b in stream.iterate(full[start][0], full[start][1])]
    assert len(tail) == len(full) - start
    assert all(a[:2] == b[:2] and a[2].equal(b[2]) for a, b in zip(full[start:], tail))


def test_epoch_sizes_counts_only_the_epochs_that_hold_enough_micro_batches(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--epochs", "1000000", "--synthetic-samples", "24")
    slot_w = position_weights(cfg.block_size, cfg.gamma).numpy()
    stream = BatchStream(open_dataset(cfg), cfg, slot_w)
    first = stream.epoch_sizes(enough=5)
    assert sum(first) >= 5 and sum(first[:-1]) < 5  # the epochs 5 micro-batches reach, and no more
    longer = stream.epoch_sizes(enough=3 * sum(first))  # extended on the same stream
    assert longer[: len(first)] == first and sum(longer) >= 3 * sum(first) and len(longer) < 100
    small = _cfg(tmp_path, "--epochs", str(len(longer)), "--synthetic-samples", "24")
    assert BatchStream(open_dataset(small), small, slot_w).epoch_sizes() == longer  # same counts as counting all
    seeded = BatchStream(open_dataset(cfg), cfg, slot_w, known_sizes=first)  # a pre-flight's prefix, then extended
    assert seeded.epoch_sizes(enough=sum(longer)) == longer


def test_preflight_counts_epochs_only_up_to_max_steps(tmp_path: Path) -> None:
    """`--epochs 1000000 --max-steps N` (how a bench lets --max-steps alone end a run) counted all million epochs
    before step 0: two minutes at 7,909 samples."""
    from trainer.training.preflight import preflight

    setup = preflight(_cfg(tmp_path, "--epochs", "1000000", "--max-steps", "7", "--synthetic-samples", "24"))
    assert setup.total_steps == 7
    assert sum(setup.epoch_sizes) >= 7 and len(setup.epoch_sizes) < 100


def test_missing_and_empty_data_dirs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TrainerInputError, match="does not exist"):
        open_dataset(_cfg(tmp_path, "--data-dir", str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainerInputError, match="meta.json is missing"):
        open_dataset(_cfg(tmp_path, "--data-dir", str(tmp_path / "empty")))
    write_index(tmp_path / "empty", [], DatasetMeta())
    with pytest.raises(TrainerInputError, match="no samples"):
        open_dataset(_cfg(tmp_path, "--data-dir", str(tmp_path / "empty")))


def test_shard_with_mismatched_ids_and_mask_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _write_dataset(data_dir, [20, 30, 40, 50])
    np.save(data_dir / "shard-00001.mask.npy", np.ones(3, np.uint8))  # fewer mask values than ids
    with pytest.raises(TrainerInputError, match="shard-00001.*must agree"):
        open_dataset(_cfg(tmp_path, "--data-dir", str(data_dir)))


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _write_dataset(data_dir, [20, 30], vocab=200, meta_vocab=0)  # meta does not say: caught per batch
    cfg = _cfg(tmp_path, "--data-dir", str(data_dir))
    cfg.vocab_size = 100  # a target smaller than the data's vocabulary
    dataset = open_dataset(cfg)
    with pytest.raises(TrainerInputError, match="outside the vocabulary"):
        collate(dataset, np.array([0, 1]), 0, 0, cfg, position_weights(cfg.block_size, cfg.gamma).numpy())


def test_data_from_a_larger_vocabulary_is_refused_up_front(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _write_dataset(data_dir, [20, 30], meta_vocab=151936)
    with pytest.raises(TrainerInputError, match="vocabulary of 151936 but the target has 256"):
        open_dataset(_cfg(tmp_path, "--data-dir", str(data_dir)))


def test_shapes_are_static_per_context_bucket(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "--max-seq-len",
        "1024",
        "--token-budget",
        "2048",
        "--max-batch-size",
        "8",
        "--max-anchors",
        "64",
        "--synthetic-samples",
        "60",
    )
    assert len({padded_length(n, 1024) for n in range(1, 5000)}) == 8
    stream = BatchStream(open_dataset(cfg), cfg, position_weights(cfg.block_size, cfg.gamma).numpy())
    shapes: dict[int, set] = {}
    for batch in stream.iterate(0, 0):
        if batch.epoch > 0:
            break
        rows, seq = batch.input_ids.shape
        shapes.setdefault(seq, set()).add((rows, batch.anchors.shape[1]))
        assert (rows, seq, batch.anchors.shape[1]) == batch_shape(1, seq, cfg)
        real = int((batch.attention_mask.sum(1) > 0).sum())
        padded_rows = ~batch.keep.any(1) & ~batch.loss_mask.any(1)
        assert batch.weights[padded_rows].sum() == 0 and batch.num_ctx_tokens <= real * seq
    assert all(len(v) == 1 for v in shapes.values())  # one (R, N) per context bucket


def _epoch_batches_reference(lengths: np.ndarray, epoch: int, cfg: TrainConfig) -> list[np.ndarray]:
    """epoch_batches as first written (one padded_length call per sample): the order every existing checkpoint's
    data position refers to, so the faster version must give exactly these batches."""
    from trainer.data.batches import _ORDER_SALT

    rng = np.random.default_rng([cfg.seed, epoch, _ORDER_SALT])
    clipped = np.minimum(lengths, cfg.max_seq_len)
    order = rng.permutation(len(lengths))
    order = order[clipped[order] >= 2]
    batches: list[np.ndarray] = []
    for start in range(0, len(order), cfg.max_batch_size * 32):
        chunk = order[start : start + cfg.max_batch_size * 32]
        chunk = chunk[np.argsort(clipped[chunk], kind="stable")]
        current: list[int] = []
        longest = 0
        for sample in chunk.tolist():
            new_longest = max(longest, int(clipped[sample]))
            fits = (
                len(current) < cfg.max_batch_size
                and (len(current) + 1) * padded_length(new_longest, cfg.max_seq_len) <= cfg.token_budget
            )
            if current and not fits:
                batches.append(np.array(current, dtype=np.int64))
                current, new_longest = [], int(clipped[sample])
            current.append(sample)
            longest = new_longest
        if current:
            batches.append(np.array(current, dtype=np.int64))
    return [batches[i] for i in rng.permutation(len(batches))]


@pytest.mark.parametrize(
    "flags", [("3072", "64", "65536"), ("100", "3", "300"), ("1000", "8", "2000"), ("1024", "4", "4096")]
)
def test_epoch_batches_are_the_batches_of_the_first_version(flags: tuple[str, str, str]) -> None:
    seq, rows, budget = flags
    cfg = parse_train_args(
        ["--preset", "tiny", "--max-seq-len", seq, "--max-batch-size", rows, "--token-budget", budget]
    )
    lengths = np.random.default_rng(7).integers(0, 2 * int(seq), size=20_000)
    for epoch in (0, 3):
        fast, first = epoch_batches(lengths, epoch, cfg), _epoch_batches_reference(lengths, epoch, cfg)
        assert len(fast) == len(first) and all(np.array_equal(a, b) for a, b in zip(fast, first))
