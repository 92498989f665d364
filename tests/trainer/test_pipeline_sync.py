"""Replica sync on CPU: gradient reduction, weight averaging, replica identity, bad modes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainer.pipeline.replica_sync import (
    ReplicaSync,
    average_parameters,
    max_replica_difference,
    reduce_gradients,
    replica_checksums,
)

pytestmark = pytest.mark.timeout(30)


def _replicas(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    out = [copy.deepcopy(base) for _ in range(n)]
    for i, r in enumerate(out[1:], start=1):  # make the others differ so broadcast is observable
        with torch.no_grad():
            for p in r.parameters():
                p.add_(0.1 * i)
    return out


def test_grad_sync_sums_and_gives_every_replica_identical_bits() -> None:
    replicas = _replicas(3)
    ReplicaSync(replicas, "grad")  # broadcasts replica 0
    assert max_replica_difference(replicas) == 0.0
    inputs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for r, x in zip(replicas, inputs):
        r(x).pow(2).sum().backward()
    expected = [sum(r_p.grad.clone() for r_p in ps) for ps in zip(*(list(r.parameters()) for r in replicas))]
    reduce_gradients(replicas)
    for ps, want in zip(zip(*(list(r.parameters()) for r in replicas)), expected):
        # bitwise: (g0 + g1) + g2 in replica order, as the flat path sums (one device: the in-place path)
        assert torch.equal(ps[0].grad, want)
        assert all(torch.equal(ps[0].grad, p.grad) for p in ps[1:])


def test_missing_grads_count_as_zero() -> None:
    replicas = _replicas(2)
    ReplicaSync(replicas, "grad")
    replicas[0](torch.ones(1, 6)).sum().backward()  # replica 1 has no grads at all
    want = [p.grad.clone() for p in replicas[0].parameters()]
    reduce_gradients(replicas)
    for p0, p1, w in zip(replicas[0].parameters(), replicas[1].parameters(), want):
        torch.testing.assert_close(p0.grad, w)
        assert torch.equal(p0.grad, p1.grad)


def test_replicas_on_one_device_follow_replica_zero() -> None:
    """--sync grad with every replica on one device: replica 0's gradients become the sum (the bits
    reduce_gradients gives every replica), the followers' gradients are freed, and after replica 0's step its
    weights are copied into the followers; a missing gradient counts as zero."""
    replicas = _replicas(3)
    sync = ReplicaSync(replicas, "grad")
    assert sync.followers
    for number, r in enumerate(replicas[:2]):  # replica 2 has no gradients at all
        r(torch.randn(4, 6, generator=torch.Generator().manual_seed(number))).pow(2).sum().backward()
    want = [a.grad + b.grad for a, b in zip(replicas[0].parameters(), replicas[1].parameters())]  # (g0 + g1) + 0
    sync.after_backward()
    for p, w in zip(replicas[0].parameters(), want):
        assert torch.equal(p.grad, w)
    assert all(p.grad is None for r in replicas[1:] for p in r.parameters())
    with torch.no_grad():
        for p in replicas[0].parameters():
            p.sub_(0.01 * p.grad)  # replica 0's optimizer step
    sync.after_step(1)
    assert max_replica_difference(replicas) == 0.0


def test_average_mode_averages_every_interval_and_before_checkpoint() -> None:
    replicas = _replicas(2)
    sync = ReplicaSync(replicas, "average", interval=2)
    with torch.no_grad():
        for p in replicas[1].parameters():
            p.add_(1.0)
    mean = [(a.detach() + b.detach()) / 2 for a, b in zip(replicas[0].parameters(), replicas[1].parameters())]
    sync.after_step(1)
    assert max_replica_difference(replicas) > 0.5  # not on step 1
    sync.after_step(2)
    assert max_replica_difference(replicas) == 0.0
    for p, m in zip(replicas[0].parameters(), mean):
        torch.testing.assert_close(p.detach(), m)
    with torch.no_grad():
        next(replicas[1].parameters()).add_(2.0)
    sync.before_checkpoint()
    assert max_replica_difference(replicas) == 0.0


def test_average_parameters_is_plain_mean() -> None:
    replicas = _replicas(3)
    want = [sum(ps) / 3 for ps in zip(*(list(p.detach().clone() for p in r.parameters()) for r in replicas))]
    average_parameters(replicas)
    for p, w in zip(replicas[2].parameters(), want):
        torch.testing.assert_close(p.detach(), w)


def test_bad_sync_settings_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="--sync must be one of"):
        ReplicaSync(_replicas(2), "allreduce")
    with pytest.raises(ValueError, match="--sync-interval must be >= 1"):
        ReplicaSync(_replicas(2), "average", interval=0)
    with pytest.raises(ValueError, match="--sync must be one of grad, average, got 'none'"):
        ReplicaSync(_replicas(1), "none")
    with pytest.raises(ValueError, match="different parameter layout"):
        reduce_gradients([nn.Linear(2, 2), nn.Linear(3, 2)])


@pytest.mark.parametrize("wait", ["device", "stream"])
def test_a_bad_sync_wait_is_a_clear_error_before_the_first_step(monkeypatch: pytest.MonkeyPatch, wait: str) -> None:
    """$DFLASH_SYNC_WAIT (how the sync waits for its own copies: stream, the default, or device) is checked when the
    sync is made, before any step; either good value gives the sum (on CPU replicas there is no stream to wait for)."""
    monkeypatch.setenv("DFLASH_SYNC_WAIT", "everything")
    with pytest.raises(ValueError, match=r"\$DFLASH_SYNC_WAIT must be one of device, stream, got 'everything'"):
        ReplicaSync(_replicas(2), "grad")
    monkeypatch.setenv("DFLASH_SYNC_WAIT", wait)
    replicas = _replicas(2)
    sync = ReplicaSync(replicas, "grad")
    for r in replicas:
        r(torch.ones(1, 6)).sum().backward()
    want = [p0.grad + p1.grad for p0, p1 in zip(replicas[0].parameters(), replicas[1].parameters())]
    sync.after_backward()
    assert all(torch.equal(p0.grad, w) for p0, w in zip(replicas[0].parameters(), want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replica_checksums_see_a_one_bit_change(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(dtype)
    b = copy.deepcopy(a)
    first, second = replica_checksums([a, b])
    assert first == second and len(first) == 16
    with torch.no_grad():
        flat = b[1].weight.view(-1)
        flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf"), dtype=dtype))  # one ulp: a few bits
    assert len(set(replica_checksums([a, b]))) == 2
