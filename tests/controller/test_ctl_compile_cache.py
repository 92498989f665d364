"""Warm compiles across code versions (issue 28, item 3): one compile cache per target and machine kind, shared by
every release, with no stale kernel ever run. Real torch.compile with Inductor's CPU backend, real deploys and
restarts on the local target: a job compiles `scale` from a module of its release and prints the result and
torch's own cache counters.

`scale` is a matrix product: Inductor lowers it to its extern mm kernel, so the FX graph is compiled and cached
(the entries these tests count, keyed by the traced graph: what keeps a stale compile from being served) but no
C++ kernel is generated. With an element-wise body every job that compiled into an empty cache built Inductor's
vector-ISA probes and its kernel with g++ (~7 CPU-s; this file's six jobs: 58.6 -> 37.2 CPU-s in all, issue 29
item 11); what the C++ compiler does is torch's, not what these tests check."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.controller.helpers import Env
from tests.controller.test_ctl_reliability import add_profile

pytestmark = pytest.mark.slow

JOB = """\
import json
import sys
import torch
from trainer.core import compile_cache
from scaled import scale

cache = compile_cache.choose(torch.device("cpu"))
out = torch.compile(scale)(torch.arange(4.0).reshape(2, 2))
print(json.dumps({"out": out.tolist(), "cache": str(cache), "tag": TAG, **compile_cache.stats()}), flush=True)
with open("status.json", "w") as handle:  # as trainer.training.loop records it (docs/run-directory.md, status.json)
    json.dump({"compile_cache": {"dir": str(cache), **compile_cache.stats()}}, handle)
"""


def write_release_files(env: Env, body: str, tag: str) -> None:
    (env.root / "scaled.py").write_text(f"def scale(x):\n    return {body}\n")
    (env.root / "compiled_job.py").write_text(f"TAG = {tag!r}\n" + JOB)


def result(env: Env, run: str, workspace: str = "ws") -> dict:
    log = env.root / workspace / "runs" / run / "train.log"
    return json.loads(log.read_text().strip().splitlines()[-1])


def test_a_code_change_compiles_only_what_changed_and_never_runs_a_stale_kernel(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    add_profile(
        env,
        "compiled",
        """
argv: ["{python}", "{release}/compiled_job.py"]
files: [compiled_job.py, scaled.py]
""",
    )
    write_release_files(env, "x @ x", "v1")
    code, _, err = env.cli(
        "deploy", "--profile", "compiled", "--name", "cc1", "--launcher", "nohup", "--wait", '"out"', "--timeout",
        "600", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    first = result(env, "cc1")
    assert first["out"] == [[2.0, 3.0], [6.0, 11.0]] and first["fxgraph_miss"] >= 1  # cold: compiled
    assert first["cache"].startswith(str(env.workspace / "cache" / "compile" / "py3."))

    write_release_files(env, "x @ x", "v2")  # a change outside the compiled function: a new release
    code, _, err = env.cli(
        "restart", "cc1", "--unchecked", "--name", "cc2", "--wait", '"out"', "--timeout", "600", capsys=capsys
    )
    assert code == 0, err
    second = result(env, "cc2")
    assert second["tag"] == "v2" and second["out"] == first["out"]
    assert second["cache"] == first["cache"]  # one cache for both code versions ...
    assert second["fxgraph_hit"] >= 1 and second["fxgraph_miss"] == 0  # ... so nothing compiled again

    write_release_files(env, "x.t() @ x", "v3")  # the compiled function's body changed
    code, _, err = env.cli(
        "restart", "cc2", "--unchecked", "--name", "cc3", "--wait", '"out"', "--timeout", "600", capsys=capsys
    )
    assert code == 0, err
    third = result(env, "cc3")
    assert third["out"] == [[4.0, 6.0], [6.0, 10.0]]  # the new code's result, not the cached kernel's
    assert third["cache"] == first["cache"] and third["fxgraph_miss"] >= 1

    code, _, err = env.cli(
        "restart",
        "cc3",
        "--unchecked",
        "--name",
        "cc4",
        "--clear-cache",
        "--wait",
        '"out"',
        "--timeout",
        "600",
        capsys=capsys,
    )
    assert code == 0, err
    assert "cleared the compile caches of local: " in err
    fourth = result(env, "cc4")
    assert fourth["out"] == third["out"] and fourth["fxgraph_hit"] == 0 and fourth["fxgraph_miss"] >= 1  # cold

    code, out, _ = env.cli("doctor", "--profile", "compiled", "--json", capsys=capsys)
    check = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}["compile cache"]
    assert check["status"] == "ok" and "warm for the current code" in check["detail"], check
    assert "its run cc4 compiled 1 graph(s) and reused 0" in check["detail"], check
    shutil.rmtree(fourth["cache"])  # emptied by hand: nothing left to reuse, so not "warm" (issue 45 item 3)
    Path(fourth["cache"]).mkdir()
    code, out, _ = env.cli("doctor", "--profile", "compiled", "--json", capsys=capsys)
    check = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}["compile cache"]
    assert check["detail"].startswith("not warm for the current code") and "holds none now" in check["detail"], check
    write_release_files(env, "x.t() @ x", "v5")  # code no run has used yet
    code, out, _ = env.cli("doctor", "--profile", "compiled", "--json", capsys=capsys)
    check = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}["compile cache"]
    assert "no run of the current code" in check["detail"] and "files" in check["detail"], check


def test_a_fresh_workspace_starts_warm_from_a_compile_cache_it_shares(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two targets (two workspaces: a fresh container's, say) with one `compile_cache:` folder (a bind mount of
    one GPU kind): the first deploy in the fresh workspace compiles nothing."""
    shared = env.root / "shared-cache"
    text = env.inventory.read_text().replace(
        "    workspace: ws\n", "    workspace: ws\n    compile_cache: shared-cache\n"
    )
    second = "  fresh:\n    kind: local\n    workspace: ws-fresh\n    python: PY\n    compile_cache: shared-cache\n"
    env.inventory.write_text(text.replace("profiles:\n", second.replace("PY", sys.executable) + "profiles:\n", 1))
    add_profile(env, "compiled", 'argv: ["{python}", "{release}/compiled_job.py"]\nfiles: [compiled_job.py, scaled.py]')
    write_release_files(env, "x @ x", "v1")
    for target, run in (("local", "fw1"), ("fresh", "fw2")):
        code, _, err = env.cli(
            "deploy", target, "--profile", "compiled", "--name", run, "--launcher", "nohup", "--wait", '"out"',
            "--timeout", "600", capsys=capsys,
        )  # fmt: skip
        assert code == 0, err
    first, fresh = result(env, "fw1"), result(env, "fw2", "ws-fresh")
    assert first["cache"] == fresh["cache"] and fresh["cache"].startswith(str(shared))
    assert first["fxgraph_miss"] >= 1 and fresh["fxgraph_miss"] == 0 and fresh["fxgraph_hit"] >= 1
