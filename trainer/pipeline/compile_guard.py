"""Compile discipline for a threaded trainer (docs/method.md#compiling).

torch.compile is not thread safe: two threads compiling at once raise "Detected that you are using FX to
symbolically trace a dynamo-optimized function" or deadlock on the lazily compiled backward, and any later
recompile (new shape, device or guard) reopens that race. So:

1. `warm_up(variants, run_one)`: in the main thread, before any worker starts, run forward AND backward once
   for every (drafter device x shape bucket x mask variant), one after another. The dynamo recompile limit is
   raised to cover all of them first (default 8 per code object; one device or bucket more and flex_attention
   would silently fall back to the unfused path that materialises the score matrix).
2. `CompileGuard` (a context manager around the threaded phase) makes any compile after warm-up a hard error:
   - `torch.compiler.set_stance("fail_on_recompile")`: dynamo raises instead of compiling, so a compile
     never even starts in a worker thread (no race, no half-compiled state);
   - `fail_on_recompile_limit_hit`: hitting the limit raises instead of falling back to eager;
   - the warning "flex_attention called without torch.compile()" becomes an exception;
   - `check()` compares dynamo's compile counters with the post-warm-up snapshot (belt and braces).
   `translate(exc)` turns the raw torch errors into `CompileGuardError` with the worker's device named.
The stance and warning filters are process-global; they are set and restored by the main thread only while no
worker runs, which is the one moment that is safe.
3. No two workers share a dynamo cache: every compiled callable of a drafter replica is compiled from a private
   copy of its function (trainer/core/compile_scope.py). Even with nothing left to compile, two threads looking up
   one code object's cache entries at the same time make the lookup fail now and then, which under the guard
   is a CompileGuardError (3 of 8 H200 runs before the fix; tests/trainer/test_compile_scope.py).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, TypeVar

import torch
import torch._dynamo
from torch._dynamo.utils import counters

V = TypeVar("V")

FLEX_EAGER_WARNING = "flex_attention called without torch.compile"
_RECOMPILE_MARKER = "fail_on_recompile"


class CompileGuardError(RuntimeError):
    """A compile happened (or flex_attention ran eagerly) after warm-up: a shape or device was not warmed up."""


def compile_counts() -> dict[str, int]:
    """Dynamo frames compiled, graphs produced, and AOT (forward+backward) compilations so far in this process."""
    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "aot_autograd": int(counters["aot_autograd"]["total"]),
    }


@dataclass
class WarmupReport(Generic[V]):
    seconds_per_variant: list[tuple[V, float]]
    total_s: float
    compiles: dict[str, int]  # compile counters accrued during warm-up

    def summary(self) -> str:
        parts = ", ".join(f"{variant}: {secs:.1f} s" for variant, secs in self.seconds_per_variant)
        return f"warm-up of {len(self.seconds_per_variant)} variants took {self.total_s:.1f} s ({parts}); compiles {self.compiles}"


def warm_up(
    variants: Sequence[V], run_one: Callable[[V], None], log: Callable[[str], None] = lambda m: None
) -> WarmupReport[V]:
    """Run `run_one(variant)` (a full forward + backward) for every variant, sequentially, in the calling thread.

    Must be called from the main thread before worker threads exist. Raises the recompile limit so that all
    variants fit (each replica's compiled callables make their own entries, the loss kernels one per chunk
    shape), with room for the separate graphs dynamo makes around graph breaks."""
    # Each replica compiles private copies (trainer/core/compile_scope.py), so one code object sees only its own
    # replica's entries: one per shape bucket x layer type / chunk shape. The limit only has to cover that.
    needed = 4 * len(variants) + 8
    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed
    if torch._dynamo.config.accumulated_recompile_limit < 4 * needed:
        torch._dynamo.config.accumulated_recompile_limit = 4 * needed
    # Hitting the limit even here must fail loudly: the default is to run that code eagerly from then on, and
    # eager flex_attention materialises the full score matrix (the seed's out-of-memory).
    previous_fail_on_limit = torch._dynamo.config.fail_on_recompile_limit_hit
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    before = compile_counts()
    started = time.monotonic()
    timings: list[tuple[V, float]] = []
    try:
        for variant in variants:
            t0 = time.monotonic()
            run_one(variant)
            timings.append((variant, time.monotonic() - t0))
            log(f"warm-up {variant}: {timings[-1][1]:.1f} s")
    finally:
        torch._dynamo.config.fail_on_recompile_limit_hit = previous_fail_on_limit
    after = compile_counts()
    return WarmupReport(timings, time.monotonic() - started, {k: after[k] - before[k] for k in after})


class CompileGuard:
    """Context manager for the threaded phase: any compile inside it is an error (see module docstring)."""

    def __init__(self) -> None:
        self._baseline: dict[str, int] = {}
        self._previous_fail_on_limit = False
        self._warnings_ctx: warnings.catch_warnings | None = None
        self._active = False

    def __enter__(self) -> CompileGuard:
        self._baseline = compile_counts()
        self._previous_fail_on_limit = torch._dynamo.config.fail_on_recompile_limit_hit
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch.compiler.set_stance("fail_on_recompile")
        self._warnings_ctx = warnings.catch_warnings()
        self._warnings_ctx.__enter__()
        warnings.filterwarnings("error", message=FLEX_EAGER_WARNING)
        # flex_attention warns once per process; forget an earlier warning so that it fires (and raises) again.
        try:
            from torch.nn.attention import flex_attention as flex_module

            flex_module._WARNINGS_SHOWN.discard("flex_attention_performance")
        except (ImportError, AttributeError):
            pass
        self._active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._active = False
        torch.compiler.set_stance("default")
        torch._dynamo.config.fail_on_recompile_limit_hit = self._previous_fail_on_limit
        if self._warnings_ctx is not None:
            self._warnings_ctx.__exit__(exc_type, exc, tb)
            self._warnings_ctx = None

    def new_compiles(self) -> dict[str, int]:
        now = compile_counts()
        return {k: now[k] - self._baseline.get(k, 0) for k in now if now[k] != self._baseline.get(k, 0)}

    def check(self) -> None:
        """Raise CompileGuardError if anything compiled since warm-up."""
        grown = self.new_compiles()
        if grown:
            raise CompileGuardError(
                f"torch.compile compiled again after warm-up ({grown}); every (device x shape bucket x mask "
                "variant) must be warmed up before the worker threads start"
            )

    @staticmethod
    def translate(exc: BaseException, where: str) -> BaseException | None:
        """Map torch's raw recompile / eager-flex errors to a CompileGuardError naming `where`; else None."""
        text = str(exc)
        if isinstance(exc, RuntimeError) and _RECOMPILE_MARKER in text:
            return CompileGuardError(
                f"{where}: torch.compile tried to recompile after warm-up (a shape, dtype or device that was not "
                f"warmed up; recompiling in a worker thread is what raced and deadlocked the seed run)\n{text}"
            )
        if isinstance(exc, UserWarning) and FLEX_EAGER_WARNING in text:
            return CompileGuardError(
                f"{where}: flex_attention ran without torch.compile (recompile limit hit or a call outside the "
                "compiled region); it would materialise the full score matrix and exhaust memory"
            )
        return None
