"""Compile discipline on CPU with a real dynamo compile (backend aot_eager: real Dynamo + AOT autograd,
no C++ toolchain, about a second)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from trainer.pipeline.compile_guard import FLEX_EAGER_WARNING, CompileGuard, CompileGuardError, compile_counts, warm_up

pytestmark = pytest.mark.timeout(60)


def test_warmed_shapes_run_in_threads_and_a_new_shape_is_a_hard_error() -> None:
    torch._dynamo.reset()
    layer = torch.nn.Linear(8, 8)
    compiled = torch.compile(layer, backend="aot_eager", dynamic=False)
    buckets = [4, 6]

    def fwd_bwd(rows: int) -> None:
        compiled(torch.randn(rows, 8)).sum().backward()

    report = warm_up(buckets, fwd_bwd)
    assert report.compiles["aot_autograd"] >= 2 and len(report.seconds_per_variant) == 2
    assert "warm-up of 2 variants" in report.summary()
    errors: list[BaseException] = []

    def worker(rows: int) -> None:
        try:
            for _ in range(3):
                fwd_bwd(rows)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with CompileGuard() as guard:
        threads = [threading.Thread(target=worker, args=(rows,)) for rows in buckets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        guard.check()  # nothing compiled: passes
        before = compile_counts()
        with pytest.raises(RuntimeError, match="fail_on_recompile") as info:
            fwd_bwd(5)  # a bucket that was not warmed up: refused before any compile starts
        assert compile_counts() == before
        translated = CompileGuard.translate(info.value, "drafter1 on cpu")
        assert isinstance(translated, CompileGuardError) and "drafter1 on cpu" in str(translated)
    fwd_bwd(5)  # outside the guard compiling is allowed again (stance restored)


def test_check_reports_compiles_the_stance_did_not_catch() -> None:
    torch._dynamo.reset()
    with CompileGuard() as guard:
        torch.compiler.set_stance("default")  # simulate a compile that slipped past the stance
        torch.compile(lambda x: x * 3, backend="eager")(torch.ones(2))
        with pytest.raises(CompileGuardError, match="compiled again after warm-up"):
            guard.check()


def test_flex_eager_warning_becomes_an_error_inside_the_guard() -> None:
    with CompileGuard():
        query = torch.randn(1, 1, 16, 8)
        with pytest.raises(UserWarning, match=FLEX_EAGER_WARNING) as info:
            flex_attention(query, query, query)  # the real eager fallback, as after a recompile-limit hit
    translated = CompileGuard.translate(info.value, "drafter0")
    assert isinstance(translated, CompileGuardError) and "materialise the full score matrix" in str(translated)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        warnings.warn(FLEX_EAGER_WARNING, UserWarning, stacklevel=1)  # outside: only a warning again


def test_unrelated_errors_are_not_translated() -> None:
    assert CompileGuard.translate(ValueError("boom"), "x") is None
