"""Benchmark helpers and the GPU bench scripts' CPU smoke tests. The FLOP count rests on `visible_pairs`: it must equal what the mask really lets through."""

from __future__ import annotations

import ast
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.bench import bench
from trainer.bench.bench_common import datasheet_peak_tflops, visible_pairs
from trainer.model.attention import dense_mask

REPO = Path(__file__).resolve().parents[2]

torch.set_num_threads(1)


@pytest.mark.parametrize("window, causal", [(None, False), (None, True), (12, True), (12, False), (5, True)])
def test_visible_pairs_counts_the_dense_mask(window: int | None, causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        S, N, B = 40, 5, 4
        anchors = torch.randint(0, S - B, (2, N), generator=gen).sort(dim=1).values
        keep = torch.rand(2, N, generator=gen) > 0.3
        expected = int(dense_mask(anchors, keep, S, B, window=window, causal=causal).sum())
        assert visible_pairs(anchors, keep, B, window, causal) == expected


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),  # not the SXM's 989: the longest key wins
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
    ],
)
def test_mfu_is_against_the_cards_own_datasheet_peak(name: str, tflops: float) -> None:
    assert datasheet_peak_tflops(name) == tflops


def test_a_card_the_table_does_not_know_gets_no_datasheet_mfu() -> None:
    assert math.isnan(datasheet_peak_tflops("NVIDIA RTX PRO 6000 Blackwell Server Edition"))


def test_bench_step_runs_on_cpu_and_reports_no_recompiles(capsys) -> None:
    """The compiled variant with dynamo's aot_eager backend: real guards, recompiles and AOT autograd, no code
    generation. With Inductor its cold C++ build (the vector-ISA probes, then a g++ run per kernel) exceeded
    pytest-timeout's 300 s on a fresh clone of a busy 2-core machine (issue 45 item 6); what the test checks, that
    a warmed-up step does not recompile, is dynamo's, whatever the backend generates."""
    assert (
        bench.main(
            [
                "step",
                "--compile-backend",
                "aot_eager",
                "--preset",
                "tiny",
                "--shape",
                "tiny",
                "--variants",
                "eager,unsorted",
                "--iters",
                "1",
                "--warmup",
                "1",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in table if line.startswith("tiny")]
    assert [r[2] for r in rows] == ["eager", "unsorted"] and all(r[-1] == "0" for r in rows)


@pytest.mark.parametrize("flag, value", [("--shape", "huge"), ("--variants", "turbo"), ("--layouts", "zigzag")])
def test_unknown_shape_or_variant_is_a_clear_error(capsys, flag: str, value: str) -> None:
    assert bench.main(["step", "--preset", "tiny", flag, value, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: unknown {flag[2:].rstrip('s')} {value!r}") and "hint:" in err


def test_a_failed_variant_is_reported_and_its_settings_restored(capsys) -> None:
    """triton-nopad switches the padding off and then fails on a CPU (its loss kernels need CUDA): the failure is
    one line, the next variant still runs, and the module setting is back to its default."""
    from trainer.model import attention

    args = ["step", "--preset", "tiny", "--shape", "tiny", "--variants", "triton-nopad,eager", "--device", "cpu"]
    assert bench.main([*args, "--iters", "1", "--warmup", "1"]) == 0
    captured = capsys.readouterr()
    assert "triton-nopad ...\n  failed: TrainerInputError" in captured.err
    assert [line.split()[2] for line in captured.out.splitlines() if line.startswith("tiny")] == ["eager"]
    assert attention.FLEX_PAD_TO_TILES is True


def test_bench_attention_runs_both_layouts_on_cpu(capsys) -> None:
    args = ["attention", "--preset", "tiny", "--shape", "tiny", "--layers", "full", "--orders", "sorted"]
    assert bench.main([*args, "--layouts", "bhsd,bshd", "--iters", "1", "--warmup", "1", "--device", "cpu"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny")]
    assert [r[4] for r in rows] == ["bhsd", "bshd"]


@pytest.mark.parametrize(
    "script, args",
    [
        ("checkpoint_pause.py", ["--preset", "tiny", "--device", "cpu", "--repeats", "1"]),
        ("gpu_pipeline.py", ["--scale", "smoke", "--device", "cpu", "--steps", "12", "--modes", "dual"]),
        ("gpu_pipeline.py", ["--scale", "specforge-smoke", "--device", "cpu", "--steps", "12", "--modes", "dual"]),
    ],
)
def test_gpu_bench_scripts_run_their_cpu_smoke_test(tmp_path, script: str, args: list[str]) -> None:
    """The scripts the GPU runs use: a broken import or flag here would fail a GPU run."""
    repo = Path(__file__).resolve().parents[2]
    extra = ["--dir", str(tmp_path)] if script == "checkpoint_pause.py" else ["--log-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(repo / "bench" / script), *args, *extra],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "|" in done.stdout if script == "checkpoint_pause.py" else " ok" in done.stdout
    if "specforge-smoke" in args:  # the full-depth target's default taps, and samples/s = block tokens/s / (N x B)
        (row,) = json.loads(done.stdout.splitlines()[-1])
        assert (row["target_layers"], row["taps"], row["recompiles_after_warmup"]) == (12, [1, 5, 9], 0)
        assert row["samples_s"] == pytest.approx(row["block_tok_s"] / (16 * 4), rel=0.01) and row["samples_s"] > 0


BENCH_TIMEOUT_S = 420  # its CPU smoke test took ~100 s at load ~12 with a cold Inductor cache on the 2-core CPU machine


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 120)  # its own limit first, then the teardown of what it started
def test_the_restart_cycle_bench_runs_its_cpu_smoke_test(tmp_path) -> None:
    """bench/restart_cycle.py through the real CLI on the local target, tiny shapes on the CPU: a deploy, a
    restart with the hand-over, started by the standby interpreter the deploy left (real torch imported ahead;
    the only test of a real trainer's adoption) and resumed from its parent's final checkpoint, and a restart with
    a bad flag that the check in a fork of the next standby refuses while the old run trains on.

    The bench's other modes repeat paths the controller tests cover with less CPU (issue 29 item 11: this test
    took ~86 CPU-s with all of them, ~41 with these two): a change outside the compiled code (a new release that
    compiles nothing) and inside it (only the changed graph recompiles) in test_ctl_compile_cache.py's
    code-change test and test_ctl_standby.py's code-change adoption; a syntax error (refused by the agent's
    compile step before any interpreter) in test_ctl_preflight.py; --wait-exit in test_ctl_handover.py; the fresh
    workspace (a standby started for the launch, checked in and adopted; the carried compile artifacts) in
    test_ctl_standby.py's first-launch test and test_compile_cache_artifacts.py. The line the code-change-inside
    mode edits is checked below without a run."""
    from tests.controller.helpers import cleanup  # stops a workspace's runs by their recorded groups

    # The bench may edit the code it deploys (its code-change and bad-code modes): it runs from a copy of the
    # checkout, so a test running beside it in another worker never imports edited code.
    repo = tmp_path / "checkout"
    for part in ("bench", "dflashops", "trainer"):
        shutil.copytree(REPO / part, repo / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    args = ["--scale", "smoke", "--device", "cpu", "--modes", "handover,bad-flag", "--steps", "3"]
    bench_run = subprocess.Popen(
        [sys.executable, str(repo / "bench" / "restart_cycle.py"), *args, "--workdir", str(tmp_path / "work")],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The bench's runs and standbys are in sessions of their own (setsid, as every dflashops run): killing the
    # bench does not reach them, and a bench killed by a timeout (subprocess.run's SIGKILL, pytest-timeout) left
    # them training for good, reparented to PID 1 (issue 45 item 6). So: SIGTERM first (the bench stops what it
    # started as it exits), within pytest-timeout's limit, then every run of its workspace by its recorded group.
    try:
        out, err = bench_run.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        bench_run.terminate()
        out, err = bench_run.communicate(timeout=60)
        pytest.fail(f"the restart-cycle bench took over {BENCH_TIMEOUT_S} s:\n{out[-2000:]}{err[-2000:]}")
    finally:
        if bench_run.poll() is None:
            bench_run.kill()
            bench_run.wait()
        cleanup(tmp_path / "work" / "ws")
    done = subprocess.CompletedProcess(bench_run.args, bench_run.returncode, out, err)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("handover |")]
    assert [row[1] for row in rows] == ["True"], "the restart did not adopt the standby"
    assert "bad-flag: refused in " in done.stdout and "invalid int value: 'abc'" in done.stdout
    assert done.stdout.count("old run trains on: True") == 1
    compiled = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"mode": "handover"')]
    assert len(compiled) == 1  # the child compiled for its batch shapes before it read the checkpoint
    assert compiled[0]["compiled"] is not None and compiled[0]["compiled"] <= compiled[0]["resumed"], compiled
    assert "old exit 143: yes" in done.stdout


def test_the_restart_cycle_bench_edits_a_line_the_drafter_has() -> None:
    """`--modes code-change-inside` (run on the GPU machine, not here) edits one line of drafter.py's MLP: that
    line must still be there, once, or the GPU run fails at the bench's own assertion."""
    source = (REPO / "bench" / "restart_cycle.py").read_text()
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in ("MLP_LINE", "MLP_EDITED")
    }  # fmt: skip
    drafter = (REPO / "trainer" / "model" / "drafter.py").read_text()
    assert drafter.count(constants["MLP_LINE"]) == 1
    assert constants["MLP_EDITED"] != constants["MLP_LINE"] and constants["MLP_EDITED"] not in drafter


def test_the_session_8_variant_builds_the_mask_before_the_forward() -> None:
    """triton-s8 wraps DFlashDrafter.forward so that the mask is built first (the order before 2026-12-02's last 8-15 ms work): same
    hidden states, and the mask is built before the context's fc runs."""
    import functools

    from trainer.model import DFlashDrafter

    _, dcfg = bench.preset_config("tiny", bench.SHAPES["tiny"], [])
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    shape = bench.SHAPES["tiny"]
    batch = bench.synthetic_batch(dcfg, shape, 7.0, torch.device("cpu"), sorted_anchors=True)
    ctx = torch.randn(shape.rows, shape.ctx, dcfg.num_taps * dcfg.hidden_size)
    emb = torch.randn(shape.rows, shape.anchors * shape.block, dcfg.hidden_size)
    order: list[str] = []
    drafter.fc.register_forward_pre_hook(lambda *_: order.append("fc"))
    build = drafter.build_mask

    def recording_build(*args, **kwargs):
        order.append("mask")
        return build(*args, **kwargs)

    drafter.build_mask = recording_build  # type: ignore[method-assign]
    expected = drafter(ctx, emb, batch.anchors, batch.keep, "dense")
    assert order == ["fc", "mask"]  # today's order: the context's fc queued first
    order.clear()
    wrapped = functools.partial(bench._mask_first, drafter.forward, drafter.build_mask)
    assert torch.equal(wrapped(ctx, emb, batch.anchors, batch.keep, "dense"), expected)
    assert order == ["mask", "fc"]


def test_the_compiled_targets_fp32_reference_measures_rounding_per_tap() -> None:
    """bench pipeline --target-compile rates the eager and the compiled bf16 taps against the target's own
    weights run in float32: zero for the float32 forward itself, bf16-sized for the bf16 one, and per tap."""
    from transformers import Qwen3Config

    from trainer.bench.bench_common import SHAPES, preset_config, synthetic_batch
    from trainer.model import TargetModel
    from trainer.training.step import TargetSide

    cfg, dcfg = preset_config("tiny", SHAPES["tiny"], [])
    hf = Qwen3Config(**cfg.tiny_target)
    taps = dcfg.target_layer_ids
    target = TargetModel.from_config(hf, taps, dtype=torch.bfloat16)
    batch = synthetic_batch(dcfg, SHAPES["tiny"], cfg.gamma, torch.device("cpu"), sorted_anchors=True)
    reference = bench._fp32_taps(target, batch)
    assert reference.dtype == torch.float32
    bf16 = TargetSide(target, "cpu").features(batch).ctx_features
    errors = bench._relative_rms_per_tap(bf16, reference, len(taps))
    assert len(errors) == len(taps) >= 2 and all(1e-4 < e < 3e-2 for e in errors)  # bf16's rounding, not a fault
    assert bench._relative_rms_per_tap(reference, reference, len(taps)) == [0.0] * len(taps)
    moved = reference.clone()
    moved[..., -hf.hidden_size :] *= 1.5  # only the last tap's slice
    assert bench._relative_rms_per_tap(moved, reference, len(taps)) == pytest.approx(
        [0.0] * (len(taps) - 1) + [0.5], abs=1e-5
    )
