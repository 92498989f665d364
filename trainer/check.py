"""`python -m trainer check <train flags>`: would `python -m trainer train <train flags>` start? Everything that can
refuse it, in the order of what each costs, without training and without writing anything:

  1. every module of the trainer package compiles (a syntax error anywhere, also in a module `train` imports
     only late): ~0.1 s, no torch;
  2. the flags parse and validate (trainer.core.config): no torch;
  3. the training stack the flags pick imports (trainer.train and its engine: torch; seconds on a cold
     interpreter, nothing in a standby that has them already);
  4. `train`'s own pre-flight (trainer.training.preflight: the target's config, the data, the drafter shape, the resume
     checkpoint readable and of this shape, --init-from, the loss kernels). A --target-model's config is read
     through transformers; the tiny preset's target is its own values, so its check imports no transformers
     (~1 of ~2.3 CPU-s a check: transformers' import reads the `__all__` of every model file it ships).

Prints `ok: ...` and exits 0, or one `error:` line that names the file and line or the flag, then a `hint:`,
and exits 2. dflashops runs it in the target on the new release before a restart stops the old run, and before
a deploy launches (its pre-flight): a typo then costs an error line, not a stopped run.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

from trainer.core.config import TrainConfig, TrainerInputError, parse_train_args

EXIT_OK, EXIT_REFUSED = 0, 2


def compile_package() -> None:
    """Compile every .py file of this trainer package (in memory: nothing written); the first SyntaxError is a
    TrainerInputError naming its file and line."""
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        try:
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except SyntaxError as exc:
            where = f"{relative(path)}:{exc.lineno}" if exc.lineno else relative(path)
            raise TrainerInputError(
                f"{where}: {type(exc).__name__}: {exc.msg}",
                hint="fix the file, then restart again: nothing was stopped",
            ) from None


def import_training_stack(cfg: TrainConfig) -> None:
    """Import what `train` imports for these flags; an exception while importing is a TrainerInputError
    naming the innermost trainer file and line it came from."""
    modules = ["trainer.train", "trainer.training.loop", "trainer.training.single_engine"]
    if cfg.pipeline or len(cfg.target_gpus) > 1 or len(cfg.drafter_gpus) > 1:
        modules.append("trainer.pipeline_run")
    if cfg.nodes > 1:
        modules.append("trainer.distributed_run")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import-time failure refuses the run, with its place
            raise TrainerInputError(
                f"{innermost_trainer_frame(exc) or module}: {type(exc).__name__}: {exc}",
                hint="fix it, then restart again: nothing was stopped",
            ) from None


def innermost_trainer_frame(exc: BaseException) -> str | None:
    """`trainer/x.py:LINE` of the deepest traceback frame inside this package, or None."""
    root = Path(__file__).resolve().parent
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if path.is_absolute() and path.resolve().is_relative_to(root):
            found = f"{relative(path)}:{frame.lineno}"
    return found


def relative(path: Path) -> str:
    """`trainer/...` for a file of this package (what a user edited), else the path as it is."""
    root = Path(__file__).resolve().parent
    try:
        return str(Path(root.name) / path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def check(argv: list[str]) -> str:
    """Steps 1-4 of the module doc; a summary line, or TrainerInputError."""
    compile_package()
    cfg = parse_train_args(argv)
    import_training_stack(cfg)
    from trainer.training.preflight import preflight

    # Under torchrun only node 0 reads checkpoints (trainer.distributed_run); this node's rank is unknown here, so a
    # --resume checkpoint that is not on this node's disk is node 0's to check.
    resume_here = cfg.nodes == 1 or cfg.resume in ("auto", "never") or Path(cfg.resume).exists()
    setup = preflight(cfg, reads_checkpoints=resume_here)
    resume = f", resumes from {setup.resume_from}" if setup.resume_from else ""
    return f"ok: {setup.total_steps} optimizer steps{resume}"


def main(argv: list[str]) -> int:
    try:
        print(check(argv), flush=True)
    except TrainerInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    return EXIT_OK
