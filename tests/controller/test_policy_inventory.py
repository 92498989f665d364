"""Issue 17's inventory keys: `on_failure`, `stall` (profiles) and `notify` (top level), parsed with units,
and every bad value refused with file:line:key, exit 2, nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashops.core.inventory import load_inventory
from dflashops.core.inventory_policy import parse_duration, parse_percent, shown_url

BASE = "profiles:\n  p:\n    argv: [x]\n"


def test_durations_and_percentages() -> None:
    assert [parse_duration(v) for v in ("90", "90s", "1.5m", "2h", "500ms", 7, "15 m")] == [
        90.0,
        90.0,
        90.0,
        7200.0,
        0.5,
        7.0,
        900.0,
    ]
    assert [parse_duration(v) for v in ("", "10d", "-5s", "m", True, "1e3")] == [None] * 6
    assert [parse_percent(v) for v in ("5%", "2.5", 0, "100%")] == [5.0, 2.5, 0.0, 100.0]
    assert [parse_percent(v) for v in ("101%", "-1", "five", False)] == [None] * 4


def test_a_full_policy_parses(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        BASE + "    on_failure: {resume: false, max_restarts: 2, backoff: 1m, exit_codes: [1, 137]}\n"
        "    stall: {heartbeat: 15m, gpu_util_below: 5%, for: 10m, grace: 30s}\n"
        "notify:\n  webhook: http://127.0.0.1:9/hook?token=abc\n  command: [echo, hi]\n"
        "  events: [crashed, stalled]\n  from_target: true\n  timeout: 3s\n"
    )
    inventory = load_inventory(path)
    profile = inventory.profile("p")
    assert profile.on_failure is not None and profile.stall is not None and inventory.notify is not None
    assert (
        profile.on_failure.resume,
        profile.on_failure.max_restarts,
        profile.on_failure.backoff_s,
        profile.on_failure.exit_codes,
    ) == (False, 2, 60.0, (1, 137))
    assert (profile.stall.heartbeat_s, profile.stall.gpu_util_below, profile.stall.for_s, profile.stall.grace_s) == (
        900.0,
        5.0,
        600.0,
        30.0,
    )
    assert inventory.notify.events == ("crashed", "stalled") and inventory.notify.command == ("echo", "hi")
    assert inventory.notify.from_target and inventory.notify.timeout_s == 3.0
    defaults = load_inventory(_write(tmp_path, BASE + "    on_failure: {}\n")).profile("p").on_failure
    assert defaults is not None and (defaults.resume, defaults.max_restarts, defaults.backoff_s) == (True, 3, 60.0)


def test_webhook_urls_are_shown_without_their_secrets() -> None:
    assert (
        shown_url("https://user:pw@hooks.example.org/services/T0/B0/XYZ?token=abc")
        == "https://hooks.example.org/<redacted>"
    )
    assert shown_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert "abc" not in shown_url("http://h/?k=abc")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            BASE + "    on_failure: {max_restarts: many}\n",
            "inventory.yaml:4: profiles.p.on_failure.max_restarts: expected int",
        ),
        (
            BASE + "    on_failure: {max_restarts: 1000}\n",
            "inventory.yaml:4: profiles.p.on_failure.max_restarts: expected 0-100",
        ),
        (
            BASE + "    on_failure: {backoff: soon}\n",
            "inventory.yaml:4: profiles.p.on_failure.backoff: expected a duration",
        ),
        (
            BASE + "    on_failure: {exit_codes: [0]}\n",
            "inventory.yaml:4: profiles.p.on_failure.exit_codes: exit codes are 1-255",
        ),
        (BASE + "    on_failure: {retries: 3}\n", "inventory.yaml:4: profiles.p.on_failure.retries: unknown key"),
        (BASE + "    on_failure: yes\n", "inventory.yaml:4: profiles.p.on_failure: expected a mapping"),
        (BASE + "    stall: {for: 10m}\n", "inventory.yaml:4: profiles.p.stall: set heartbeat"),
        (BASE + "    stall: {heartbeat: 0s}\n", "inventory.yaml:4: profiles.p.stall.heartbeat: expected a duration"),
        (BASE + "    stall: {heartbeat: 10d}\n", "inventory.yaml:4: profiles.p.stall.heartbeat: expected a duration"),
        (
            BASE + "    stall: {gpu_util_below: 150%}\n",
            "inventory.yaml:4: profiles.p.stall.gpu_util_below: expected a perc",
        ),
        (
            BASE + "notify:\n  webhook: ftp://x/y\n",
            "inventory.yaml:5: notify.webhook: expected an http:// or https:// URL",
        ),
        (BASE + "notify:\n  events: [crashed]\n", "inventory.yaml:5: notify: set webhook, webhook_env and/or command"),
        (
            BASE + "notify:\n  command: [x]\n  events: [exploded]\n",
            "inventory.yaml:6: notify.events: unknown event 'exploded'",
        ),
        (
            BASE + "notify:\n  webhook: http://h/\n  webhook_env: H\n",
            "inventory.yaml:6: notify.webhook_env: give webhook or",
        ),
        (BASE + "notify:\n  webhook_env: 1BAD\n", "inventory.yaml:5: notify.webhook_env: invalid environment variable"),
        (BASE + "notify:\n  command: []\n", "inventory.yaml:5: notify.command: must not be empty"),
        (BASE + "notify:\n  command: [x]\n  when: always\n", "inventory.yaml:6: notify.when: unknown key"),
        (BASE + "notify:\n  command: [x]\n  retry: 5s\n", "inventory.yaml:6: notify.retry: expected a list"),
        (BASE + "notify:\n  command: [x]\n  retry: [5s, soon]\n", "notify.retry[1]: expected a duration"),
        (
            "hosts:\n  h: {address: 127.0.0.1}\ntargets:\n  t: {kind: pct, host: h, ctid: 200, workspace: /w, "
            "compile_cache: shared}\n" + BASE,
            "targets.t.compile_cache: must be an absolute path",
        ),
    ],
)
def test_bad_policy_values_are_refused_with_their_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    from dflashops.cli.main import main

    path = _write(tmp_path, text)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["--inventory", str(path), "status"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    first, second = err.splitlines()[:2]
    assert first.startswith("error: ") and expected in first, first
    assert second.startswith("hint: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no lineage.sqlite, no workspace
