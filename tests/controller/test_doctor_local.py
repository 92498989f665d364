"""`dflashops doctor` on the local target: a CPU target passes, secrets are checked by name only, bad input
is refused before anything runs, and the doctor itself changes nothing (no workspace, no lineage file)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.controller.helpers import Env


def test_cpu_target_passes_and_names_secrets_only(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORKLOAD_SECRET", raising=False)
    code, out, err = env.cli("doctor", "--json", capsys=capsys)
    checks = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}
    assert code == 0, err
    assert checks["torch"]["status"] == "ok" and checks["cuda"]["status"] == "skip"
    assert checks["secret WORKLOAD_SECRET"]["status"] == "warn"  # the `work` profile passes it; unset here
    assert not env.workspace.exists() and not env.db.exists()  # the probe came on stdin: nothing written

    monkeypatch.setenv("WORKLOAD_SECRET", "s3cr3t-value-never-shown")
    code, out, err = env.cli("doctor", "--profile", "work", capsys=capsys)
    line = next(line for line in out.splitlines() if "secret WORKLOAD_SECRET" in line)
    assert code == 0 and line.split()[1] == "ok"
    assert "s3cr3t-value-never-shown" not in out + err


def test_declared_gpus_on_a_machine_without_any_fail(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    env.inventory.write_text(
        env.inventory.read_text().replace("    workspace: ws\n", "    workspace: ws\n    gpus: [0]\n")
    )
    code, out, err = env.cli("doctor", "local", capsys=capsys)
    fails = {line.split()[2] for line in out.splitlines() if " FAIL " in line}
    assert code == 1 and fails == {"gpu", "nvidia-smi", "cuda"}, out  # "gpu devices" splits at the space
    assert err.splitlines()[-2].startswith("error: doctor: 3 check(s) failed on local")
    assert err.splitlines()[-1].startswith("hint: ")


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["doctor", "nowhere"], 3, "error: unknown target 'nowhere'"),
        (["doctor", "local", "--all"], 2, "error: give a TARGET or --all, not both"),
        (["doctor", "--profile", "nope"], 3, "error: unknown profile 'nope'"),
    ],
)
def test_bad_input(env: Env, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str) -> None:
    got, out, err = env.cli(*argv, capsys=capsys)
    assert (got, out) == (code, "") and err.startswith(message) and "\nhint: " in err
    assert not env.workspace.exists() and not env.db.exists()


@pytest.mark.parametrize("python", ["/nonexistent/bin/python3", "/bin/true"], ids=["missing", "not-python"])
def test_a_failed_python_check_skips_the_checks_that_need_it(
    env: Env, capsys: pytest.CaptureFixture[str], python: str
) -> None:
    env.inventory.write_text(
        env.inventory.read_text().replace(f"    python: {sys.executable}\n", f"    python: {python}\n")
    )
    code, out, err = env.cli("doctor", "local", "--json", capsys=capsys)
    checks = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}
    assert code == 1 and checks["python"]["status"] == "fail" and python in checks["python"]["detail"], out
    for name in ("torch", "cuda", "transformers", "triton"):
        assert checks[name]["status"] == "skip", checks.get(name)
        assert checks[name]["detail"] == f"the python check failed ({python} cannot run)", checks[name]
    assert [c["name"] for c in checks.values() if c["status"] == "fail"] == ["python"]  # nothing judged on it
    assert checks["tmux"]["status"] == "ok" and checks["workspace"]["status"] == "ok"  # the rest still ran


def test_a_secret_only_a_profile_the_target_cannot_run_needs_is_no_warning(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped inventory's case (issue 46 item 8): `qwen3-8b` needs 4 GPUs and passes HF_TOKEN; the CPU
    `local` target cannot run it, so an unset HF_TOKEN is a skip line there, unless that profile is named."""
    env.inventory.write_text(
        env.inventory.read_text()
        + '  big:\n    argv: ["{python}", -m, trainer, train, --target-gpus, "0,1", --drafter-gpus, "2,3"]\n'
        "    pass_env: [HF_TOKEN, WORKLOAD_SECRET]\n"
    )
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("WORKLOAD_SECRET", raising=False)
    code, out, err = env.cli("doctor", "--json", capsys=capsys)
    checks = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}
    assert code == 0, err
    assert checks["secret HF_TOKEN"]["status"] == "skip", checks["secret HF_TOKEN"]
    assert "big" in checks["secret HF_TOKEN"]["detail"] and "4 GPU(s)" in checks["secret HF_TOKEN"]["detail"]
    assert checks["secret WORKLOAD_SECRET"]["status"] == "warn"  # `work` runs here and passes it too
    assert "big" not in checks["secret WORKLOAD_SECRET"]["detail"]
    code, out, err = env.cli("doctor", "--profile", "big", "--json", capsys=capsys)  # asked for: checked
    checks = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}
    assert checks["secret HF_TOKEN"]["status"] == "warn", checks["secret HF_TOKEN"]
