"""Launch a Triton kernel with the first block configuration that fits the device (issue 31, item 5).

The seeds' GPUs are Blackwell (SM 12.0, ~100 KB of shared memory per block) where the H200 has 227 KB: a
configuration tuned on the H200 may not launch there. `launch_first_fit` walks a kernel's configuration ladder
(fastest first): it compiles each for the device (`JITFunction.warmup`, no launch), skips those whose
`metadata.shared` exceeds the limit, launches the first that fits, and treats a launch that still fails for
resources (`OutOfResources`) as "does not fit" too. The verdict is kept per (kernel, device, specialisation), so
the walk costs one compile per configuration once, then a dict lookup. One log line names a fallback.

The limit is the device's opt-in shared memory per block, or $DFLASH_SMEM_LIMIT (bytes, "99K" allowed) to rehearse
a smaller GPU on a larger one: configurations over it are then refused exactly as that GPU would refuse them.
Under TRITON_INTERPRET=1 nothing is compiled and every configuration fits unless the variable says otherwise
(then the first configuration counts as not fitting, so tests walk the ladder on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

SMEM_ENV = "DFLASH_SMEM_LIMIT"


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Around a launch: Triton launches on the current CUDA device's current stream, torch ops on the tensors'
    device, so make them agree (the pipeline's drafter threads each own a GPU). Nothing on the CPU (interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (persistent grids size by it); 2 under the CPU interpreter, enough
    to exercise a kernel's row loop."""
    if device.type != "cuda":
        return 2
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


class NoConfigFitsError(RuntimeError):
    """No configuration of a kernel's ladder fits the device: the caller takes its non-Triton path."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def parse_bytes(text: str) -> int:
    """'101376' or '99K' -> bytes (ValueError names the text)."""
    text = text.strip().upper()
    scale = 1024 if text.endswith("K") else 1
    try:
        return int(text.rstrip("K")) * scale
    except ValueError:
        raise ValueError(f"${SMEM_ENV}={text!r}: expected bytes, e.g. 101376 or 99K") from None


def smem_limit(device: torch.device) -> int | None:
    """Shared memory a block of `device` may use (bytes): $DFLASH_SMEM_LIMIT, else the device's opt-in limit
    (None on CPU: the interpreter has none)."""
    text = os.environ.get(SMEM_ENV, "").strip()
    if text:
        return parse_bytes(text)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) or None


_VERDICT: dict[tuple, int] = {}  # (kernel name, device, specialisation) -> index of the configuration chosen
_LOGGED: set[tuple] = set()


def chosen(name: str) -> dict[tuple, int]:
    """The verdicts recorded for kernel `name` (tests and benches read which rung was taken)."""
    return {key: index for key, index in _VERDICT.items() if key[0] == name}


def launch_first_fit(
    name: str,
    kernel: Any,
    configs: Sequence[Any],
    launch_args: Callable[[Any], tuple[tuple, tuple, dict]],
    device: torch.device,
    specialisation: tuple,
) -> Any:
    """Launch `kernel` with the first of `configs` that fits; returns that configuration.

    launch_args(config) -> (grid, positional args, keyword args incl. constexprs, num_warps, num_stages).
    Raises NoConfigFitsError when none fits (the caller's fallback), naming each rung's shared memory."""
    from triton.runtime.errors import OutOfResources

    key = (name, str(device), specialisation)
    limit = smem_limit(device)
    first = _VERDICT.get(key, 0)
    reasons = []
    for index in range(first, len(configs)):
        config = configs[index]
        grid, args, kwargs = launch_args(config)
        if key not in _VERDICT:  # the fit is checked once per specialisation, then trusted
            if _interpreting():
                if limit is not None and index == 0 and os.environ.get(SMEM_ENV):
                    reasons.append(f"{config}: refused (forced limit {limit} B under the interpreter)")
                    continue
            elif limit is not None:
                shared = int(kernel.warmup(*args, grid=grid, **kwargs).metadata.shared)
                if shared > limit:
                    reasons.append(f"{config}: {shared} B shared > {limit} B")
                    continue
        try:
            kernel[grid](*args, **kwargs)
        except OutOfResources as exc:
            reasons.append(f"{config}: {exc}")
            _VERDICT.pop(key, None)
            continue
        if key not in _VERDICT:
            _VERDICT[key] = index
            if index > 0 and key not in _LOGGED:
                _LOGGED.add(key)
                print(f"triton {name}: using {config} on {device} ({'; '.join(reasons)})", file=sys.stderr, flush=True)
        return config
    raise NoConfigFitsError(f"triton {name}: no configuration fits {device}: {'; '.join(reasons)}")


def fits(
    name: str,
    kernel: Any,
    configs: Sequence[Any],
    launch_args: Callable[[Any], tuple[tuple, tuple, dict]],
    device: torch.device,
) -> Any | None:
    """The first configuration whose compiled kernel fits the device, without launching (None if none does);
    for --loss-kernels auto, which must never pick a kernel that cannot launch."""
    limit = smem_limit(device)
    if limit is None or _interpreting():
        return configs[0]
    for config in configs:
        grid, args, kwargs = launch_args(config)
        try:
            if int(kernel.warmup(*args, grid=grid, **kwargs).metadata.shared) <= limit:
                return config
        except Exception:  # noqa: BLE001 - a configuration that does not even compile does not fit
            continue
    return None
