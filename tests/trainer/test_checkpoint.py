"""trainer.state.checkpoint (atomic save, keep-last-K, shape check, resume resolution) and trainer.core.signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainer.core.config import TrainerInputError
from trainer.state.checkpoint import (
    CheckpointWriteError,
    CheckpointWriter,
    check_shapes,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    snapshot_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(run: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, keep: int = 3) -> Path:
    return save_checkpoint(
        run,
        step,
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        scheduler={"last_epoch": step},
        epoch=1,
        index=step + 1,
        extra={"note": "x"},
        keep=keep,
    )


def test_round_trip_restores_every_part_exactly(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    torch.manual_seed(123)
    path = _save(tmp_path, 7, model, optimizer)
    expected_draw = torch.rand(3)
    state = load_checkpoint(path)
    assert (state.step, state.epoch, state.index, state.scheduler, state.extra["note"]) == (
        7,
        1,
        8,
        {"last_epoch": 7},
        "x",
    )
    assert all(torch.equal(state.model[k], v) for k, v in model.state_dict().items())
    restored = torch.optim.AdamW(model.parameters(), lr=0.1)
    restored.load_state_dict(state.optimizer)
    for a, b in zip(restored.state.values(), optimizer.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    torch.manual_seed(999)
    from trainer.state.checkpoint import restore_rng

    restore_rng(state.rng)
    assert torch.equal(torch.rand(3), expected_draw)


def test_only_the_newest_k_are_kept_and_incomplete_ones_are_ignored(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, model, optimizer, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]
    torn = tmp_path / "checkpoints" / "step_000050"  # a directory without state.json: a torn copy
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]
    assert resolve_resume("auto", tmp_path) == tmp_path / "checkpoints" / "step_000040"
    stale = tmp_path / "checkpoints" / ".tmp-step_000060-1"  # a crash mid-save
    stale.mkdir()
    _save(tmp_path, 60, model, optimizer, keep=2)
    assert not stale.exists() and not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def _snapshot(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    return snapshot_checkpoint(
        step,
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        scheduler={"last_epoch": step},
        epoch=0,
        index=step,
        extra={},
    )


def test_background_write_keeps_the_state_of_its_step_while_training_goes_on(tmp_path: Path) -> None:
    """The snapshot is a private copy: steps taken (and random numbers drawn) after `submit` do not leak into
    the checkpoint, though the write happens later on another thread."""
    model, optimizer = _model_and_optimizer()
    torch.manual_seed(5)
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = next(iter(optimizer.state.values()))["exp_avg"].clone()
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    with CheckpointWriter(tmp_path, keep=3) as writer:
        writer.submit(_snapshot(2, model, optimizer))
        for _ in range(3):  # training goes on: in-place updates of the very tensors the state dicts refer to
            model(torch.randn(5, 4)).sum().backward()
            optimizer.step()
        torch.rand(7)
        written = writer.wait()
    assert written == [tmp_path / "checkpoints" / "step_000002"]
    state = load_checkpoint(written[0])
    assert all(torch.equal(state.model[k], v) for k, v in expected_model.items())
    assert not torch.equal(state.model["0.weight"], model.state_dict()["0.weight"])  # the updates did happen
    assert torch.equal(next(iter(state.optimizer["state"].values()))["exp_avg"], expected_moment)
    from trainer.state.checkpoint import restore_rng

    restore_rng(state.rng)
    assert torch.equal(torch.rand(3), expected_draw)


def test_background_writes_land_in_step_order_and_prune(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    landed = []
    with CheckpointWriter(tmp_path, keep=2) as writer:
        for step in (10, 20, 30):
            writer.submit(_snapshot(step, model, optimizer))  # waits for the write before it, if still running
            landed += writer.poll()
        landed += writer.wait()
    assert [p.name for p in landed] == ["step_000010", "step_000020", "step_000030"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]


def test_the_next_snapshot_reuses_the_host_buffers_of_the_last_written_one(tmp_path: Path) -> None:
    """One snapshot's worth of host memory per run: after a write lands its buffers take the next snapshot."""
    model, optimizer = _model_and_optimizer()
    parts = lambda: dict(  # noqa: E731
        model=model.state_dict(), optimizer=optimizer.state_dict(), scheduler={}, epoch=0, index=0, extra={}
    )
    with CheckpointWriter(tmp_path, keep=3) as writer:
        first = writer.snapshot(1, **parts())
        addresses = [t.data_ptr() for t in first.buffers]
        writer.submit(first)
        writer.wait()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        second = writer.snapshot(2, **parts())
        assert [t.data_ptr() for t in second.buffers] == addresses
        assert torch.equal(second.model["0.weight"], model.state_dict()["0.weight"])  # the new values
        writer.submit(second)
        writer.wait()
    assert torch.equal(
        load_checkpoint(tmp_path / "checkpoints" / "step_000002").model["0.weight"], model.state_dict()["0.weight"]
    )
    assert not torch.equal(
        load_checkpoint(tmp_path / "checkpoints" / "step_000001").model["0.weight"], model.state_dict()["0.weight"]
    )


def test_a_failed_background_write_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("a file where the checkpoints directory belongs\n")  # a real fault
    model, optimizer = _model_and_optimizer()
    with CheckpointWriter(tmp_path, keep=2) as writer:
        writer.submit(_snapshot(5, model, optimizer))
        with pytest.raises(CheckpointWriteError, match=r"writing checkpoint step_000005 failed: FileExistsError"):
            writer.wait()
        assert writer.poll() == []  # reported once
    assert (tmp_path / "checkpoints").read_text().startswith("a file")  # nothing else touched


def test_shape_mismatch_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, 1, model, optimizer)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    check_shapes(path, shapes)
    with pytest.raises(TrainerInputError, match=r"0.weight is \[3, 4\] there, \[8, 4\] here"):
        check_shapes(path, {**shapes, "0.weight": [8, 4]})
    with pytest.raises(TrainerInputError, match="lacks 2.weight"):
        check_shapes(path, {**shapes, "2.weight": [1]})


def test_resume_modes(tmp_path: Path) -> None:
    assert resolve_resume("auto", tmp_path / "fresh") is None
    assert resolve_resume("never", tmp_path / "fresh") is None
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, 3, model, optimizer)
    with pytest.raises(TrainerInputError, match="already holds checkpoints"):
        resolve_resume("never", tmp_path)
    assert resolve_resume(str(path), tmp_path / "other") == path
    with pytest.raises(TrainerInputError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / "nothing"), tmp_path)


_SIGNAL_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    import torch
    from trainer.state.checkpoint import save_checkpoint
    from trainer.core.signals import STOP_SIGNALS, GracefulStop

    run, save_s = Path(sys.argv[1]), float(sys.argv[2])
    before = [signal.getsignal(s) for s in STOP_SIGNALS]
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with GracefulStop(on_force=lambda signum: (run / "forced").write_text(str(signum))) as stop:
        print("ready", flush=True)
        step = 0
        while True:  # the training loop: finish the step, then look at the flag
            step += 1
            time.sleep(0.01)
            if stop.requested:
                break
        print("saving", flush=True)
        time.sleep(save_s)  # a long checkpoint write: where a second signal lands
        save_checkpoint(run, step, model=model.state_dict(), optimizer=optimizer.state_dict(), scheduler={},
                        epoch=0, index=step, extra={"signal": stop.signum}, keep=1)
    print("handlers restored", [signal.getsignal(s) for s in STOP_SIGNALS] == before, flush=True)
    sys.exit(stop.exit_code)
""")


def _start_training(run: Path, save_s: float) -> subprocess.Popen:
    """A stand-in training loop under GracefulStop in its own process, once its handlers are installed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGNAL_SCRIPT, str(run), str(save_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if line != "ready\n":
        proc.kill()
        pytest.fail(f"the training process did not start: {line!r} {proc.communicate()[1]}")
    return proc


STOP_SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_a_stop_signal_finishes_the_step_saves_a_checkpoint_and_exits_128_plus_signum(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc = _start_training(tmp_path, 0)
    try:
        proc.send_signal(sig)  # from outside, as `dflashops stop` (SIGTERM), a closed terminal or Ctrl-C do
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"received {sig.name}: finishing the current step, then saving a checkpoint" in err
    assert "saving" in out and "handlers restored True" in out  # GracefulStop's exit put the old handlers back
    [(step, path)] = list_checkpoints(tmp_path)
    assert step >= 1 and load_checkpoint(path).extra["signal"] == sig
    assert not (tmp_path / "forced").exists()


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: s.name)
def test_a_second_signal_exits_at_once_without_a_checkpoint(tmp_path: Path, sig: signal.Signals) -> None:
    proc = _start_training(tmp_path, 60)
    try:
        proc.send_signal(sig)
        assert proc.stdout is not None and proc.stdout.readline() == "saving\n"
        proc.send_signal(sig)  # during the (60 s) save
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"received {sig.name} again: exiting now without a checkpoint" in err
    assert "handlers restored" not in out and list_checkpoints(tmp_path) == []
    assert (tmp_path / "forced").read_text() == str(int(sig))  # on_force ran first (status.json says so)
