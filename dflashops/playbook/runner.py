"""Running a loaded playbook: steps in order, `on_failure` handling, and a report per step.

`run_playbook(invocation, playbook, overrides, target=..., check=...)` returns a PlayReport: one StepReport
per step (ok / changed / failed / skipped / recovered, duration, detail, and in check mode the exact
commands it would run), the tables that `collect` steps filled, and the error that stopped the playbook
(None when it completed). on_failure: `stop` (default) ends the playbook, later steps are `skipped`;
`continue` reports the failure and goes on; `restart-with-resume` relaunches the step's run from its
latest checkpoint as a child run (ops.restart), retries the step once on that child, and makes later
steps that name the old run use the child.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dflashops.core.errors import DflashopsError
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.restart import RestartRequest, restart
from dflashops.playbook import Playbook, Step
from dflashops.playbook.expr import ExprSyntaxError
from dflashops.playbook.steps import STEP_FUNCTIONS, Context, StepOutcome, latest_running_run
from dflashops.playbook.vars import PlaybookError, render


@dataclass
class StepReport:
    index: str
    label: str
    kind: str
    status: str  # ok | changed | failed | skipped | recovered | planned
    seconds: float
    detail: str
    where: str
    commands: list[str] = field(default_factory=list)


@dataclass
class PlayReport:
    playbook: str
    check: bool
    variables: dict[str, Any]
    steps: list[StepReport] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    error: DflashopsError | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.error is None else self.error.exit_code

    def to_dict(self) -> dict[str, Any]:
        return {
            "playbook": self.playbook,
            "check": self.check,
            "variables": self.variables,
            "completed": self.error is None,
            "exit_code": self.exit_code,
            "error": None if self.error is None else self.error.message,
            "steps": [asdict(step) for step in self.steps],
            "tables": self.tables,
        }


class _Runner:
    def __init__(self, ctx: Context, report: PlayReport, on_step: Callable[[StepReport], None]) -> None:
        self.ctx, self.report, self.on_step = ctx, report, on_step
        self.renamed: dict[str, str] = {}  # old run -> child started by restart-with-resume

    def add(self, entry: StepReport) -> None:
        self.report.steps.append(entry)
        self.on_step(entry)

    def steps(self, steps: list[Step], prefix: str) -> None:
        for number, step in enumerate(steps, 1):
            index = f"{prefix}{number}"
            if self.report.error is not None:
                self.add(
                    StepReport(index, self.label(step), step.kind, "skipped", 0.0, "an earlier step failed", step.where)
                )
            elif step.kind == "loop":
                self.loop(step, index)
            else:
                self.one(step, index)

    def loop(self, step: Step, index: str) -> None:
        started = time.monotonic()
        try:
            items = render(step.args["items"], self.ctx.scope)
            if not isinstance(items, list):
                raise PlaybookError(f"{step.where}: loop items must be a list, got {items!r}")
        except DflashopsError as exc:
            self.add(
                StepReport(index, step.label, "loop", "failed", time.monotonic() - started, exc.message, step.where)
            )
            self.report.error = exc
            return
        self.add(StepReport(index, step.label, "loop", "ok", 0.0, f"{len(items)} items", step.where))
        name = str(step.args.get("as", "item"))
        for number, item in enumerate(items, 1):
            self.ctx.scope[name] = item
            self.steps(step.body, f"{index}.{number}.")

    def attempt(self, step: Step) -> tuple[StepOutcome, list[str]]:
        invocation = self.ctx.invocation
        before = Counter(invocation.plan)
        args = render(step.args, self.ctx.scope)
        while isinstance(args.get("run"), str) and args["run"] in self.renamed:
            args["run"] = self.renamed[args["run"]]
        try:
            outcome = STEP_FUNCTIONS[step.kind](self.ctx, args)
        except ExprSyntaxError as exc:
            raise PlaybookError(f"{step.where}: {exc}") from None
        new_lines = []
        for line in invocation.plan:  # the commands this step added to the dry-run plan, in order
            if before[line]:
                before[line] -= 1
            else:
                new_lines.append(line)
        return outcome, new_lines + list(outcome.result.pop("commands", []))

    def label(self, step: Step) -> str:
        try:
            return str(render(step.label, self.ctx.scope))
        except DflashopsError:
            return step.label

    def one(self, step: Step, index: str) -> None:
        started = time.monotonic()
        self.ctx.say(f"[{index}] {step.kind}: {step.label} ...")
        try:
            outcome, commands = self.attempt(step)
        except DflashopsError as exc:
            self.failed(step, index, started, exc)
            return
        status = "planned" if self.ctx.check else ("changed" if outcome.changed else "ok")
        self.finish(step, index, started, status, outcome, commands)

    def finish(
        self, step: Step, index: str, started: float, status: str, outcome: StepOutcome, commands: list[str]
    ) -> None:
        if step.register:
            self.ctx.scope[step.register] = outcome.result
        self.add(
            StepReport(
                index,
                self.label(step),
                step.kind,
                status,
                time.monotonic() - started,
                outcome.detail,
                step.where,
                commands,
            )
        )

    def failed(self, step: Step, index: str, started: float, exc: DflashopsError) -> None:
        self.add(
            StepReport(
                index, self.label(step), step.kind, "failed", time.monotonic() - started, exc.message, step.where
            )
        )
        if step.on_failure == "continue":
            return
        if step.on_failure == "restart-with-resume" and not self.ctx.check:
            self.recover(step, index, exc)
            return
        self.report.error = exc

    def recover(self, step: Step, index: str, exc: DflashopsError) -> None:
        started = time.monotonic()
        run = render(step.args["run"], self.ctx.scope)
        run = self.renamed.get(run, run)
        try:
            outcome = restart(
                self.ctx.invocation,
                RestartRequest(
                    run=str(run),
                    name="+",
                    resume=True,
                    unchecked=True,  # a revival of a run its step judged failed, as a supervisor's: not checked
                    note=f"restart-with-resume after step {index} failed: {exc.message.splitlines()[0][:160]}",
                ),
            )
        except DflashopsError as recovery_error:
            self.add(
                StepReport(
                    f"{index}r",
                    f"restart {run} with resume",
                    "restart",
                    "failed",
                    time.monotonic() - started,
                    recovery_error.message,
                    step.where,
                )
            )
            self.report.error = recovery_error
            return
        child = outcome.deployed.name
        self.renamed[str(run)] = child
        self.add(
            StepReport(
                f"{index}r",
                f"restart {run} with resume",
                "restart",
                "recovered",
                time.monotonic() - started,
                f"relaunched as {child} from {outcome.checkpoint}",
                step.where,
            )
        )
        retry_started = time.monotonic()
        try:
            retried, commands = self.attempt(step)
        except DflashopsError as again:
            self.add(
                StepReport(
                    f"{index}'",
                    self.label(step),
                    step.kind,
                    "failed",
                    time.monotonic() - retry_started,
                    again.message,
                    step.where,
                )
            )
            self.report.error = again
            return
        self.finish(step, f"{index}'", retry_started, "changed" if retried.changed else "ok", retried, commands)


def run_playbook(
    invocation: Invocation,
    playbook: Playbook,
    overrides: dict[str, Any],
    *,
    target: str | None = None,
    check: bool = False,
    say: Callable[[str], None] = lambda text: None,
    on_step: Callable[[StepReport], None] = lambda entry: None,
) -> PlayReport:
    """Run (or, with `check`, plan) every step. Bad variables raise PlaybookError before any step runs;
    a failing step is reported and handled by its on_failure (the report carries the stopping error)."""
    values = playbook.bind(overrides)
    if target is not None or playbook.uses("target", values):
        values.setdefault("target", invocation.inventory.target(target).name)  # unknown target: NotFound now
    if playbook.uses("latest_run", values) and "latest_run" not in values:
        values["latest_run"] = latest_running_run(invocation, target)
    shown = {key: render(value, values) for key, value in values.items()}
    report = PlayReport(playbook=str(playbook.path), check=check, variables=shown)
    ctx = Context(invocation=invocation, target=target, check=check, scope=dict(values), say=say, tables=report.tables)
    _Runner(ctx, report, on_step).steps(playbook.steps, "")
    return report
