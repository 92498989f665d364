"""An inventory `identity_file` whose PEM armour holds a damaged body (issue 27, item 10) is refused before
connecting, naming the file, instead of a failed "ssh handshake"; keys paramiko cannot load only because they
are encrypted or of a type it does not support are let through (the connection reports what happens). Real key
files made by ssh-keygen (and cryptography, paramiko's own dependency, for PKCS#8), damaged by hand."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import cli, write_inventory
from remote_harness import Harness
from test_item18_remote_errors import assert_one_error

from dflashops.core.errors import TransportError
from dflashops.transport.ssh_keys import check_identity_file

GARBAGE_OPENSSH = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot base64 at all\n-----END OPENSSH PRIVATE KEY-----\n"
GARBAGE_RSA = "-----BEGIN RSA PRIVATE KEY-----\nnot base64 at all\n-----END RSA PRIVATE KEY-----\n"


def keygen(folder: Path, name: str, *options: str) -> Path:
    """A new private key by ssh-keygen (skipped where this ssh-keygen cannot make that kind)."""
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed")
    path = folder / name
    done = subprocess.run(
        ["ssh-keygen", "-q", "-N", "", *options, "-f", str(path)], capture_output=True, text=True, input=""
    )
    if done.returncode != 0:
        pytest.skip(f"ssh-keygen {' '.join(options)} is not supported here: {done.stderr.strip()}")
    return path


def body_cut(key: Path, keep_end_line: bool) -> str:
    """The key with the second half of its base64 body gone (a copy that stopped early), its END line kept
    or gone too."""
    lines = key.read_text().splitlines()
    body = lines[1:-1]
    return "\n".join([lines[0], *body[: len(body) // 2], *([lines[-1]] if keep_end_line else [])]) + "\n"


def damaged(folder: Path, kind: str) -> Path:
    path = folder / f"damaged-{kind}"
    if kind == "garbage-openssh":
        path.write_text(GARBAGE_OPENSSH)
    elif kind == "garbage-rsa":
        path.write_text(GARBAGE_RSA)
    elif kind == "ed25519-cut":
        path.write_text(body_cut(keygen(folder, "ed", "-t", "ed25519"), keep_end_line=False))
    elif kind == "ed25519-cut-end-kept":
        path.write_text(body_cut(keygen(folder, "ed", "-t", "ed25519"), keep_end_line=True))
    elif kind == "rsa-pem-cut-end-kept":
        path.write_text(body_cut(keygen(folder, "rsa", "-t", "rsa", "-b", "2048", "-m", "PEM"), keep_end_line=True))
    elif kind == "rsa-cut-bytes":  # cut at a byte, mid-line, as a full disk or a killed copy leaves it
        path.write_bytes(keygen(folder, "rsa", "-t", "rsa", "-b", "2048").read_bytes()[:900])
    path.chmod(0o600)
    return path


DAMAGED = [
    "garbage-openssh",
    "garbage-rsa",
    "ed25519-cut",
    "ed25519-cut-end-kept",
    "rsa-pem-cut-end-kept",
    "rsa-cut-bytes",
]


@pytest.mark.parametrize("kind", DAMAGED)
def test_a_damaged_key_is_refused_naming_the_file(tmp_path: Path, kind: str) -> None:
    path = damaged(tmp_path, kind)
    with pytest.raises(TransportError) as caught:
        check_identity_file(path, "pve")
    assert caught.value.message.startswith(f"identity file {path} (host pve) is damaged"), caught.value.message
    assert "\n" not in caught.value.message and caught.value.hint and f"ssh-keygen -y -f {path}" in caught.value.hint


def pkcs8(folder: Path, name: str) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path = folder / name
    key = ed25519.Ed25519PrivateKey.generate()
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


GOOD = {
    "ed25519": ("-t", "ed25519"),
    "rsa": ("-t", "rsa", "-b", "2048"),
    "rsa-pem": ("-t", "rsa", "-b", "2048", "-m", "PEM"),
    "ecdsa": ("-t", "ecdsa"),
    "dsa": ("-t", "dsa"),  # a type this paramiko does not load: connect says what it makes of it
}


@pytest.mark.parametrize("kind", [*GOOD, "ed25519-encrypted", "rsa-pem-encrypted", "pkcs8-ed25519"])
def test_real_keys_pass_also_those_paramiko_cannot_load(tmp_path: Path, kind: str) -> None:
    if kind == "pkcs8-ed25519":
        path = pkcs8(tmp_path, kind)
    elif kind.endswith("-encrypted"):
        options = GOOD[kind.removesuffix("-encrypted")]
        path = keygen(tmp_path, kind, *options)
        keep_format = ["-m", "PEM"] if "-m" in options else []  # a legacy PEM key (DEK-Info) stays one
        subprocess.run(
            ["ssh-keygen", "-q", "-p", "-N", "secret-words", *keep_format, "-f", str(path)],
            check=True,
            capture_output=True,
        )
        assert (b"DEK-Info" in path.read_bytes()) == bool(keep_format)
    else:
        path = keygen(tmp_path, kind, *GOOD[kind])
    check_identity_file(path, "pve")  # no error


def test_status_with_a_damaged_key_names_the_file_not_the_handshake(tmp_path: Path, harness: Harness) -> None:
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, workspace=f"/workspace/{tmp_path.name}")
    for kind in ("garbage-openssh", "ed25519-cut-end-kept"):
        key = damaged(tmp_path, kind)
        inventory.write_text(inventory.read_text().replace(str(harness.client_key), str(key)))
        code, _, err = cli("--inventory", str(inventory), "status", "--target", "ct200")
        assert_one_error(code, err, f"identity file {key} (host pve) is damaged", "ssh-keygen -y")
        assert "handshake" not in err, err
        inventory.write_text(inventory.read_text().replace(str(key), str(harness.client_key)))
    code, _, err = cli("--inventory", str(inventory), "status", "--target", "ct200")
    assert code == 0, err  # the harness's real key still connects
