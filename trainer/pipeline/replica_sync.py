"""Keep drafter replicas in agreement.

Two modes (`--sync`):
- `grad`: after every backward, the gradients of all replicas are summed (each drafter already divides its
  loss by the normalizer of the WHOLE optimizer step, all drafters included) and every replica receives the
  very same summed tensor. Replicas start equal
  (`broadcast_parameters`), apply equal optimizer updates, and so stay bitwise identical.
  Every replica on ONE device (several drafter threads on one GPU, one node): `followers` is True, the sum lands in
  replica 0's gradients only, only replica 0's optimizer steps (the engine marks the other sides followers), and
  `after_step` copies replica 0's weights into the others. Same bits as every replica stepping the same update on
  the same sum, without the copies of the sum back (4 B/param each), the followers' optimizer steps (28-32 B/param
  each: ~10 ms for a qwen3-8b replica) and their moments (8 B/param each).
- `average`: replicas step independently; every `interval` optimizer steps (and before a checkpoint) their
  weights are replaced by the mean (the seed's scheme). Optimizer states are not averaged.

Transport: with CUDA replicas on distinct devices, one `torch.cuda.nccl.all_reduce` over one flat buffer per
replica (a single collective per step, called from the main thread: the single-process multi-device NCCL API
wants every device's tensor in one call). Otherwise (CPU, or several replicas on one GPU) plain tensor ops:
sum on the first replica's device, then copy the result back.

Streams: this runs on the main thread's (default) streams while the drafter workers compute on their own. The
callers make sure the workers' streams are idle before (the workers synchronize at the end of each command);
every function here ends with `_finish`, which synchronizes every device it wrote to AFTER the last copy into
the replicas' tensors, since the next reader is a worker's optimizer step or forward on another stream. (An
earlier version synchronized after the reduction but before the copy back; on an H200 the workers then read
half-written gradients and the replicas drifted apart within 50 steps.) Cost: one device sync per call.

Across nodes (the distributed engine, trainer.dist): `across(flat)` sums one flat buffer over the nodes in place.
The sync is then hierarchical: the node's replicas are summed into one buffer (NCCL reduce to replica 0 on
distinct GPUs, else a sum on the first replica's device), that buffer crosses the nodes once (one collective
per step, the node's whole gradient in fp32: 4 bytes per trainable parameter), and the result is broadcast
back to every local replica. Every replica in the job gets the same bits, so under `grad` they stay identical.
Averages then divide by `world` (all replicas of the job), not by the local count.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

SYNC_MODES = ("grad", "average")

Across = Callable[[torch.Tensor], None]  # in place: the buffer becomes its sum over every node of the job


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _check_same_layout(replicas: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    params = [_trainable(r) for r in replicas]
    shapes = [[tuple(p.shape) for p in ps] for ps in params]
    for index, other in enumerate(shapes[1:], start=1):
        if other != shapes[0]:
            raise ValueError(f"replica {index} has a different parameter layout than replica 0")
    return params


def _use_nccl(tensors: Sequence[torch.Tensor]) -> bool:
    devices = [t.device for t in tensors]
    if not all(d.type == "cuda" for d in devices) or len({d.index for d in devices}) != len(devices):
        return False
    try:
        import torch.cuda.nccl as nccl

        return nccl.is_available(list(tensors))
    except (ImportError, RuntimeError):
        return False


def _all_reduce_sum(buffers: list[torch.Tensor], across: Across | None = None) -> None:
    """In place: every buffer becomes the sum of all buffers (and, with `across`, of every node's buffers),
    bitwise equal on every replica."""
    if across is not None:
        _hierarchical_sum(buffers, across)
        return
    if len(buffers) == 1:
        return
    if _use_nccl(buffers):
        import torch.cuda.nccl as nccl

        nccl.all_reduce(buffers)  # on each device's current stream: ordered before the caller's copies back
        return
    total = buffers[0].clone()
    for buffer in buffers[1:]:
        total += buffer.to(total.device)
    for buffer in buffers:
        buffer.copy_(total)  # the same `total` everywhere: identical bits on every replica


def _hierarchical_sum(buffers: list[torch.Tensor], across: Across) -> None:
    """Sum inside the node onto one buffer, `across` the nodes once, copy back to every local replica."""
    if len(buffers) > 1 and _use_nccl(buffers):
        import torch.cuda.nccl as nccl

        nccl.reduce(buffers, root=0)  # the node's sum lands in buffers[0] (current streams: ordered)
        across(buffers[0])
        nccl.broadcast(buffers, root=0)
        return
    total = buffers[0].clone() if len(buffers) > 1 else buffers[0]
    for buffer in buffers[1:]:
        total += buffer.to(total.device)
    across(total)
    for buffer in buffers:
        if buffer is not total:
            buffer.copy_(total)  # the same `total` everywhere: identical bits on every replica


# How `_finish` waits (`$DFLASH_SYNC_WAIT`): "stream" (the default) waits for this thread's own queue only, which
# holds every write made here: the copies and foreach ops run on this thread's current stream, and the NCCL calls
# (torch.cuda.nccl, and the process group's collectives behind `across`) are ordered on it too. "device" (the earlier
# default) waited for every stream of the device, the target thread's forward included: in the one-GPU specforge
# pipeline the main thread then spent 36-37 ms per step in the sync against 12.4-12.5, at +0.5-2.0% samples/s and
# the same bits (bench/results/pipeline.md 2026-12-04 "The replica sync waits on its own stream").
SYNC_WAITS = ("device", "stream")


def _sync_wait() -> str:
    wait = os.environ.get("DFLASH_SYNC_WAIT", "stream")
    if wait not in SYNC_WAITS:
        raise ValueError(f"$DFLASH_SYNC_WAIT must be one of {', '.join(SYNC_WAITS)}, got {wait!r}")
    return wait


def _finish(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for this thread's work on every CUDA device among `tensors`: the next reader is a drafter worker on its
    own stream, which would otherwise race the copies still queued here (one sync per device per call)."""
    whole_device = _sync_wait() == "device"
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        if whole_device:
            torch.cuda.synchronize(device)
        else:
            torch.cuda.current_stream(device).synchronize()


@torch.no_grad()
def broadcast_parameters(replicas: Sequence[nn.Module]) -> None:
    """Copy replica 0's parameters and buffers into every other replica (at start and after resume)."""
    source = replicas[0].state_dict()
    for replica in replicas[1:]:
        for name, tensor in replica.state_dict().items():
            tensor.copy_(source[name])
    _finish([t for r in replicas for t in r.state_dict().values()])


def _one_device(replicas: Sequence[nn.Module]) -> bool:
    return len({p.device for r in replicas for p in _trainable(r)}) == 1


@torch.no_grad()
def sum_gradients_into_first(replicas: Sequence[nn.Module]) -> None:
    """Replica 0's gradients become the sum over every replica (all on one device), in replica order (the bits
    reduce_gradients gives); the others' gradients are freed (they are followers: nothing reads them)."""
    params = _check_same_layout(replicas)
    for p in params[0]:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    total = [p.grad for p in params[0] if p.grad is not None]  # every one, after the line above
    for others in params[1:]:
        present = [(t, p.grad) for t, p in zip(total, others) if p.grad is not None]  # a missing one counts 0
        if present:
            torch._foreach_add_([t for t, _ in present], [g for _, g in present])
        for p in others:
            p.grad = None
    _finish(total)


@torch.no_grad()
def copy_first_to_others(replicas: Sequence[nn.Module]) -> None:
    """Every replica's trainable weights become replica 0's (one device; after replica 0's optimizer step)."""
    params = _check_same_layout(replicas)
    for others in params[1:]:
        torch._foreach_copy_([p.detach() for p in others], [p.detach() for p in params[0]])
    _finish([p for ps in params for p in ps])


@torch.no_grad()
def reduce_gradients(replicas: Sequence[nn.Module], *, across: Across | None = None) -> None:
    """Sum the gradients of all replicas (with `across`, also over the other nodes') and give every replica the
    identical result. A parameter without a gradient on a replica counts as zero there."""
    params = _check_same_layout(replicas)
    if len(replicas) == 1 and across is None:
        return
    grads: list[list[torch.Tensor]] = []
    for replica_params in params:
        for p in replica_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads.append([p.grad for p in replica_params if p.grad is not None])  # every one, after the line above
    if across is None and _one_device(replicas):
        # Every replica on one device (several drafter threads on one GPU): sum into replica 0's gradients in place
        # and copy that sum to the others, tensor by tensor. The flat path below would copy every gradient into a
        # flat buffer, clone one, add, copy back to each flat and unflatten into each replica: ~80 GB of traffic
        # per step for two qwen3-8b replicas (1.05 B fp32 gradients each) against ~21 GB here. Same bits: replica
        # 0's g0 + g1 (+ g2 ...) is the sum the flat path forms, in the same order, and every replica gets it.
        total = grads[0]
        for other in grads[1:]:
            torch._foreach_add_(total, other)
        for other in grads[1:]:
            torch._foreach_copy_(other, total)
        _finish(total)
        return
    # One flat buffer per replica: one collective instead of one per tensor (launch overhead, NCCL latency).
    flats = [_flatten_dense_tensors([p.grad for p in ps]) for ps in params]
    _all_reduce_sum(flats, across)
    for ps, flat in zip(params, flats):
        for p, reduced in zip(ps, _unflatten_dense_tensors(flat, [p.grad for p in ps])):
            assert p.grad is not None  # every one was given a gradient above
            p.grad.copy_(reduced)
    _finish(flats)


@torch.no_grad()
def average_parameters(
    replicas: Sequence[nn.Module], *, across: Across | None = None, world: int | None = None
) -> None:
    """Replace every replica's trainable parameters by the mean over all `world` replicas (default: the local
    ones; with `across`, every node's), identical on all replicas."""
    params = _check_same_layout(replicas)
    if len(replicas) == 1 and across is None:
        return
    flats = [_flatten_dense_tensors([p.detach() for p in ps]) for ps in params]
    # Average in fp32 even for bf16 weights: a bf16 sum of 8 replicas loses the low bits of small updates.
    work = [f.float() for f in flats]
    _all_reduce_sum(work, across)
    for ps, flat, summed in zip(params, flats, work):
        flat.copy_(summed / (world or len(replicas)))
        for p, averaged in zip(ps, _unflatten_dense_tensors(flat, [p.detach() for p in ps])):
            p.copy_(averaged)
    _finish(flats)


def _differences(replicas: Sequence[nn.Module]) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(parameter name, replica number, |replica 0 - that replica|) for every trainable parameter, parameter-major."""
    _check_same_layout(replicas)
    named = [[(n, p) for n, p in r.named_parameters() if p.requires_grad] for r in replicas]
    for (name, a), *others in zip(*named):
        for number, (_, b) in enumerate(others, start=1):
            yield name, number, (a.detach().float() - b.detach().float().to(a.device)).abs()


def differing_parameters(replicas: Sequence[nn.Module], limit: int = 3) -> list[str]:
    """Up to `limit` trainable parameters that differ between replica 0 and another, as "name (replica r, max |diff| x,
    n of m elements)": what a divergence report names (one host sync per parameter; only called on failure)."""
    found: dict[str, str] = {}
    for name, number, diff in _differences(replicas):
        count = int((diff != 0).sum())
        if count and name not in found:
            found[name] = (
                f"{name} (replica {number}, max |diff| {float(diff.max()):.3g}, {count} of {diff.numel()} elements)"
            )
            if len(found) >= limit:
                break
    return list(found.values())


def max_replica_difference(replicas: Sequence[nn.Module]) -> float:
    """Largest absolute difference of any trainable parameter between replica 0 and the others (0.0 = identical)."""
    return max((float(diff.max()) for _, _, diff in _differences(replicas)), default=0.0)


def replica_checksums(replicas: Sequence[nn.Module]) -> list[str]:
    """One bitwise checksum per replica over its trainable parameters, as 16 hex digits.

    Each tensor's raw words (int16 for 2-byte dtypes, int32 for 4-byte ones) are summed in int64 on the replica's
    own device, weighted by the tensor's position; a changed bit anywhere changes the sum (barring a cancelling
    second change). Cost: one pass over the weights plus an int64 copy of the largest tensor, and one host sync
    per replica, so callers do it every ~50 steps, not every step."""
    sums = []
    for params in _check_same_layout(replicas):
        total = torch.zeros((), dtype=torch.int64, device=params[0].device if params else "cpu")
        for position, p in enumerate(params, start=1):
            flat = p.detach().contiguous().view(-1)
            words = {2: torch.int16, 4: torch.int32}.get(flat.element_size(), torch.uint8)
            total += flat.view(words).to(torch.int64).sum() * position
        sums.append(f"{int(total) & 0xFFFF_FFFF_FFFF_FFFF:016x}")
    return sums


class ReplicaSync:
    """The policy object the step loop calls: `after_backward()` then, after the optimizer step, `after_step(step)`."""

    def __init__(
        self,
        replicas: Sequence[nn.Module],
        mode: str,
        interval: int = 50,
        *,
        across: Callable[[torch.Tensor, str], None] | None = None,
        world: int | None = None,
    ) -> None:
        """`across(buffer, kind)`: the cross-node sum of the distributed engine (kind "grad" or "average", for
        its byte counts); `world`: replicas in the whole job. Without `across`: this process's replicas only."""
        if mode not in SYNC_MODES:
            raise ValueError(f"--sync must be one of {', '.join(SYNC_MODES)}, got {mode!r}")
        if mode == "average" and interval < 1:
            raise ValueError(f"--sync-interval must be >= 1, got {interval}")
        _sync_wait()  # a bad $DFLASH_SYNC_WAIT is an error here, before any step, not at the first sync
        self.replicas = list(replicas)
        self.mode = mode
        self.interval = interval
        self.world = world or len(self.replicas)
        self._grad_across: Across | None = (lambda t: across(t, "grad")) if across else None
        self._average_across: Across | None = (lambda t: across(t, "average")) if across else None
        # replicas 1.. follow replica 0 (module docstring): `grad` on one node with every replica on one device
        self.followers = mode == "grad" and across is None and len(self.replicas) > 1 and _one_device(self.replicas)
        broadcast_parameters(self.replicas)

    def after_backward(self) -> None:
        if self.mode == "grad" and self.followers:
            sum_gradients_into_first(self.replicas)
        elif self.mode == "grad":
            reduce_gradients(self.replicas, across=self._grad_across)

    def after_step(self, step: int) -> None:
        """`step` counts completed optimizer steps (1 after the first)."""
        if self.followers:
            copy_first_to_others(self.replicas)
        if self.mode == "average" and step % self.interval == 0:
            average_parameters(self.replicas, across=self._average_across, world=self.world)

    def before_checkpoint(self) -> None:
        """Make replica 0 the synced drafter the checkpoint stores."""
        if self.mode == "average":
            average_parameters(self.replicas, across=self._average_across, world=self.world)
