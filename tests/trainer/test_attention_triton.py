"""Our Triton attention for the interval-form mask (trainer/kernels/attention_triton.py) against the dense back-end
in float64, on CPU through Triton's interpreter (one child process per run: TRITON_INTERPRET must not leak into
the pytest process), and the configuration ladder under a forced shared-memory limit (trainer/kernels/triton_fit.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("attention_interp_worker.py")


def _run(*flags: str) -> dict:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DFLASH_SMEM_LIMIT", "DFLASH_ATTENTION_BWD_CONFIG", "DFLASH_ATTENTION_FWD_SPLIT")
    }
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, str(WORKER), *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _run()


@pytest.mark.parametrize(
    "case", ["gqa-sorted", "causal-unsorted", "sliding", "packed-docs", "anchor-at-zero", "full-tiles"]
)
def test_forward_and_gradients_match_dense_float64(interpreted, case):
    errs = interpreted[case]
    for name in ("o", "dq", "dk", "dv"):
        assert errs[name] < 1e-12, (case, name, errs)
    assert errs["padded_rows_zero"]
    assert errs["pairs"]["partial"] > 0, errs


def test_full_pairs_take_the_unmasked_walk_and_padded_rows_keep_theirs_partial(interpreted):
    """The table's full (key tile, query tile) pairs (every row sees every key: no mask, no bounds loaded) are
    really walked in the long-context case, beside partial ones; its padded rows (keep=False) see nothing, so the
    tiles holding them must stay partial, or those rows would get gradients (padded_rows_zero above and the dense
    parity of dk, dv catch that)."""
    pairs = interpreted["full-tiles"]["pairs"]
    assert pairs["full"] > 0 and pairs["partial"] > 0, pairs


@pytest.mark.parametrize("case", ["full-tiles", "sliding"])
def test_every_backward_schedule_matches_dense_float64(interpreted, case):
    """128/64/32 keys per program, 64/32 query rows per step (sub-tiles of the table's 64-row tiles), dQ
    transposed ("t": its own accumulator layout and the kernel that transposes it back) and the softmax scale
    folded into P ("f"), the matmuls reordered ("o"), on a fresh random draw with NaN-poisoned outputs: every gradient element written and
    equal to the dense float64 one."""
    got = interpreted["schedules"][case]
    names = {"128x32", "64x64", "64x32", "32x32", "128x64-t", "128x64-f", "128x64-o", "64x32-tfo", "o"}
    names |= {"o-split-32x32", "o-split-64x128", "o-masked-64x64"}
    assert set(got["errs"]) == names, got
    assert got["pairs"]["partial"] > 0 and (case != "full-tiles" or got["pairs"]["full"] > 0), got
    for schedule, err in got["errs"].items():
        assert err < 1e-12, (case, schedule, got)


def test_mixed_dtypes_run_in_the_narrowest_and_the_kernels_refuse_them(interpreted):
    """The autocast step's fp32 q/k and bf16 v (issue 31 item 2's in-step CompilationError): interval_attention
    casts to the narrowest dtype (the all-float32 result, bit for bit; gradients in each input's dtype), and the
    kernels' entry refuses mixed dtypes with a message instead of Triton's bare source position."""
    got = interpreted["mixed-dtypes"]
    assert got["dtypes"] == ["torch.float32", "torch.float64", "torch.float64", "torch.float32"]
    assert got["equal_to_fp32"]
    assert "one dtype" in got["refused"]


def test_default_rungs_are_the_first(interpreted):
    assert interpreted["rungs"] == {"fwd": [0], "bwd": [0]}


def test_forced_limit_walks_to_the_next_rung_with_the_same_results():
    """$DFLASH_SMEM_LIMIT under the interpreter refuses each ladder's first rung (trainer/kernels/triton_fit.py): the
    kernels run on rung 1 and still match the dense float64 reference."""
    got = _run("--forced-limit")
    assert got["rungs"] == {"fwd": [1], "bwd": [1]}
    for case in ("gqa-sorted", "sliding"):
        assert max(got[case][name] for name in ("o", "dq", "dk", "dv")) < 1e-12, got[case]


def test_bwd_config_from_the_environment_leads_the_ladder_and_bad_text_is_named(monkeypatch):
    from trainer.kernels import attention_triton as T

    monkeypatch.delenv(T.BWD_ENV, raising=False)
    assert T.bwd_ladder() == T.BWD_CONFIGS
    monkeypatch.setenv(T.BWD_ENV, "64, 32, 4, 3, atomic")
    assert T.bwd_ladder() == (T.BwdConfig(64, 32, 4, 3, "atomic"), *T.BWD_CONFIGS)
    monkeypatch.setenv(T.BWD_ENV, "128,64,8,2,tma,oft")
    assert T.bwd_ladder()[0] == T.BwdConfig(128, 64, 8, 2, "tma", "tfo")
    for bad in (
        "128,64,8,2",
        "96,64,8,2,tma",
        "128,48,8,2,tma",
        "128,64,3,2,tma",
        "128,64,8,2,none",
        "a,64,8,2,tma",
        "128,64,8,2,tma,x",
        "128,64,8,2,tma,tt",
        "128,64,8,2,tma,t,f",
    ):
        monkeypatch.setenv(T.BWD_ENV, bad)
        with pytest.raises(ValueError, match=T.BWD_ENV):
            T.bwd_ladder()


def test_the_atomic_twin_of_a_tma_rung_drops_the_transposed_dq():
    """Where the TMA reduce cannot run (the interpreter, pre-Hopper GPUs) a rung accumulates dQ with atomics, and
    without flag "t" (its transposed atomics measured slower on the H200, bench/results/kernels.md 2026-12-05 "The attention backward's dQ path"); the other flags stay."""
    from trainer.kernels import attention_triton as T

    cpu = torch.device("cpu")
    assert T.effective(T.BWD_CONFIGS[0], cpu) == T.BwdConfig(128, 64, 8, 2, "atomic", "fo")
    assert T.effective(T.BwdConfig(64, 32, 4, 1, "atomic", "tf"), cpu) == T.BwdConfig(64, 32, 4, 1, "atomic", "tf")


def test_fwd_split_from_the_environment_and_bad_text_is_named(monkeypatch):
    from trainer.kernels import attention_triton as T

    monkeypatch.delenv(T.FWD_SPLIT_ENV, raising=False)
    assert T.fwd_ladder() == T.FWD_CONFIGS
    assert all(c.split for c in T.FWD_CONFIGS)  # the default since 2026-12-05
    monkeypatch.setenv(T.FWD_SPLIT_ENV, "0")
    assert not any(c.split for c in T.fwd_ladder())
    assert [(c.block_m, c.block_n) for c in T.fwd_ladder()] == [(c.block_m, c.block_n) for c in T.FWD_CONFIGS]
    monkeypatch.setenv(T.FWD_SPLIT_ENV, "1")
    assert T.fwd_ladder() == T.FWD_CONFIGS
    monkeypatch.setenv(T.FWD_SPLIT_ENV, "yes")
    with pytest.raises(ValueError, match=T.FWD_SPLIT_ENV):
        T.fwd_ladder()
