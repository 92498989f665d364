"""The agent's zipapp (ops/agent_build.py): one deterministic file built from the package, and it runs.

The content-addressed name `agent-<sha12>.pyz` is only sound when the same sources give the same bytes and a
changed source gives other bytes; these build real archives from copies of the real package."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from dflashops.ops.agent_build import PACKAGE, build_zipapp


def copy_of_package(tmp_path: Path) -> Path:
    folder = tmp_path / "agent"
    shutil.copytree(PACKAGE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_the_same_sources_give_the_same_bytes_whatever_their_times_and_modes(tmp_path: Path) -> None:
    folder = copy_of_package(tmp_path)
    first = build_zipapp(folder)
    (folder / "__pycache__").mkdir()  # what running the package from a checkout leaves behind
    (folder / "__pycache__" / "stop.cpython-312.pyc").write_bytes(b"compiled")
    for path in folder.glob("*.py"):
        os.utime(path, (1_700_000_000, 1_700_000_000))
        path.chmod(0o600)
    second = build_zipapp(folder)
    assert first == second and first == build_zipapp(PACKAGE)
    with zipfile.ZipFile(io.BytesIO(first)) as archive:
        infos = archive.infolist()
    names = [info.filename for info in infos]
    assert names == sorted(names) and "__main__.py" in names and "dflashops/agent/common.py" in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    assert {info.date_time for info in infos} == {(1980, 1, 1, 0, 0, 0)}
    assert {info.external_attr >> 16 for info in infos} == {0o100644}


def test_one_changed_source_byte_changes_the_hash(tmp_path: Path) -> None:
    folder = copy_of_package(tmp_path)
    before = hashlib.sha256(build_zipapp(folder)).hexdigest()
    stop = folder / "stop.py"
    stop.write_bytes(stop.read_bytes() + b"#")
    assert hashlib.sha256(build_zipapp(folder)).hexdigest() != before


def test_the_zipapp_runs_alone_with_the_target_python(tmp_path: Path) -> None:
    """Copied away from the checkout (so nothing of it can be imported from the repository), it answers."""
    pyz = tmp_path / "agent-x.pyz"
    pyz.write_bytes(build_zipapp())
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-I", str(pyz), "ping"], capture_output=True, text=True, cwd=tmp_path, env=clean, check=False
    )
    assert out.returncode == 0 and json.loads(out.stdout)["ok"] is True, out.stderr
    probe = "import sys; sys.path.insert(0, sys.argv[1]); from dflashops.agent import common; print(common.program())"
    where = subprocess.run([sys.executable, "-I", "-c", probe, str(pyz)], capture_output=True, text=True, check=False)
    assert where.stdout.strip() == str(pyz), where.stderr  # how the agent starts itself again: this very file


def test_every_verb_of_the_tables_names_a_function_of_the_package() -> None:
    """The verb tables name modules and functions as strings (a call imports only its own module): a typo there
    would surface only when that verb is called on a target."""
    from dflashops.agent.__main__ import RAW_VERBS, STDIN_VERBS, VERBS, verb_function

    tables = {**VERBS, **RAW_VERBS, **STDIN_VERBS}
    assert len(tables) == len(VERBS) + len(RAW_VERBS) + len(STDIN_VERBS)  # no verb in two tables
    for verb, entry in tables.items():
        assert callable(verb_function(entry)), verb
    assert verb_function(VERBS["ping"])({})["version"] == 1
