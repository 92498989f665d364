"""The condition language: what parses, what it means, and what is refused (no eval anywhere)."""

from __future__ import annotations

import pytest

from dflashops.playbook.expr import ExprSyntaxError, MissingMetric, parse

METRICS = {
    "step": 60,
    "loss": 1.5,
    "block_tok_s": 5200.0,
    "state": "running",
    "block_tok_s_per_drafter": [2500.0, 2700.0],
    "queues": {"t0": {"depth": 3}},
}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("step >= 50", True),
        ("step >= 61", False),
        ("block_tok_s > 5000", True),
        ("loss < 1", False),
        ("step >= 50 and block_tok_s > 5000", True),
        ("step > 100 or loss < 2", True),
        ("not step > 100", True),
        ("(step > 100 or loss < 2) and not state == 'stopped'", True),
        ('state == "running"', True),
        ("block_tok_s_per_drafter[1] > 2600", True),
        ("queues.t0.depth <= 2", False),
        ("step != 60", False),
        ("loss >= 1.5e0", True),
        ("state > 3", False),
        ("state != 3", True),
    ],
)
def test_conditions_evaluate(text: str, expected: bool) -> None:
    assert parse(text).evaluate(METRICS) is expected


def test_missing_metric_is_reported_by_name() -> None:
    condition = parse("step >= 1 and tau_sim > 3")
    with pytest.raises(MissingMetric) as info:
        condition.evaluate({"step": 5})
    assert info.value.name == "tau_sim"
    assert condition.names() == ["step", "tau_sim"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "step >=",
        "step >> 3",
        "__import__('os').system('true')",
        "step > 1 1",
        "(step > 1",
        "step = 3",
        "len(x) > 1",
        "a; b",
        "step >= 50 and",
    ],
)
def test_bad_conditions_are_refused(text: str) -> None:
    with pytest.raises(ExprSyntaxError):
        parse(text)
