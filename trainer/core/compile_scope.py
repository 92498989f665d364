"""Compiled callables private to one drafter replica, so no two worker threads share a dynamo cache.

Why: dynamo keeps its compiled code (cache entries and their guards) on the Python code object of the frame it
intercepts. Two threads that call compiled functions sharing one code object evaluate the same guards at the
same time, and in torch 2.11-2.13 that is not thread safe: a lookup fails although a matching entry exists
("Unexpected recompilation: runtime guards failed even though they passed during recompilation-reason
analysis") and dynamo tries to recompile inside the worker thread. Measured: the H200 pipeline runs with two
drafter threads hit it in 3 of 8 runs (bench/results/pipeline.md 2026-11-29 "Two drafter threads, ten cold runs"); on the CPU with the eager backend, two
threads calling one compiled loss kernel hit it in 11-15 of 20 trials of 200 calls each, and in 0 of 20 when
each thread's function had its own code object (tests/trainer/test_compile_scope.py keeps the latter).

So a replica compiles private copies: `private_compile(fn)` compiles a copy of `fn` with a new code object
(same globals, defaults and closure; nothing else changes). `nn.Module.compile()` is not used for the layers:
it compiles `Module._call_impl`, one code object for every module in the process.

Functions that cannot be handed to the replica directly (flex_attention is reached through `attend()`) are
looked up per `replica_scope`: the drafter side enters its scope around its forward and backward, and
`scoped(cache, key, fn)` returns the copy compiled for (key, current scope).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import types
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

_SCOPE: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("dflash_compile_scope", default=None)
_SCOPED_LOCK = threading.Lock()


def private_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a Python function or a functools.partial of one) backed by a new code object."""
    if isinstance(fn, functools.partial):
        return functools.partial(private_copy(fn.func), *fn.args, **fn.keywords)
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"private_copy needs a Python function, got {type(fn).__name__}")
    code = fn.__code__.replace()  # CPython builds a new code object: dynamo's cache lives on that identity
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(copy, fn)
    del copy.__wrapped__  # type: ignore[attr-defined]  # inspect/dynamo must not unwrap back to the shared original
    return copy


def private_compile(fn: Callable[..., Any], **compile_kwargs: Any) -> Callable[..., Any]:
    """torch.compile(private_copy(fn)) with static shapes unless `compile_kwargs` says otherwise."""
    compile_kwargs.setdefault("dynamic", False)
    return torch.compile(private_copy(fn), **compile_kwargs)


@contextlib.contextmanager
def replica_scope(key: Hashable) -> Iterator[None]:
    """Calls of `scoped` inside this block (in this thread) use the copies compiled for `key`."""
    token = _SCOPE.set(key)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def scoped(
    cache: dict[tuple[Hashable, Hashable | None], Callable[..., Any]],
    key: Hashable,
    fn: Callable[..., Any],
    **compile_kwargs: Any,
) -> Callable[..., Any]:
    """The private compiled copy of `fn` for (key, current scope), created on first use. The lock only guards
    the dict: compiling still happens at the first call, so warm up every scope before threads start."""
    full_key = (key, _SCOPE.get())
    with _SCOPED_LOCK:
        if full_key not in cache:
            cache[full_key] = private_compile(fn, **compile_kwargs)
        return cache[full_key]
