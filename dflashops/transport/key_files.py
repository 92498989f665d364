"""Is a private key file's PEM body intact? (stdlib only; used by ssh_keys.check_identity_file.)

paramiko refuses a key file for reasons the user must hear about now (its body is not base64, the copy was cut
short) and for reasons that are not the file's fault (it is encrypted; its type is valid but one this paramiko
does not load: DSA, a PKCS#8 ed25519 key). `damage(data)` tells the first kind from the second by checking the
container, not the key: the armour's END line, base64, and then the structure every key of that armour has,
down to its last byte: `openssh-key-v1` (OpenSSH's own format: magic, cipher, kdf, options, keys, private
section) or one DER SEQUENCE (PKCS#1, SEC1, PKCS#8, encrypted PKCS#8). A body that is whole passes, whatever
its type or cipher, and the connection says what it makes of the key.
"""

from __future__ import annotations

import base64
import binascii
import re

ARMOUR = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END ([A-Z0-9 ]+)-----", re.S)
OPENSSH_MAGIC = b"openssh-key-v1\0"


def damage(data: bytes) -> str | None:
    """Why the first private key armour in `data` does not hold a whole key (None when it does, or when
    there is no armour at all: the caller tells a public key or other file apart)."""
    begin = re.search(rb"-----BEGIN ([A-Z0-9 ]+)-----", data)
    if begin is None:
        return None
    found = ARMOUR.search(data, begin.start())
    label = begin.group(1).decode()
    if found is None:
        return f"its {label} has no END line (the file was cut short?)"
    if found.group(3) != found.group(1):
        return f"its BEGIN {label} ends with END {found.group(3).decode()}"
    lines = found.group(2).decode("ascii", "replace").splitlines()
    encrypted = any(":" in line for line in lines)  # RFC 1421 headers (Proc-Type, DEK-Info): legacy encryption
    if encrypted:
        lines = lines[lines.index("") + 1 :] if "" in lines else []
    try:
        body = base64.b64decode("".join(line.strip() for line in lines), validate=True)
    except (binascii.Error, ValueError) as exc:
        return f"its {label} body is not base64 ({exc})"
    if not body:
        return f"its {label} body is empty"
    if encrypted:
        return None  # ciphertext: its structure shows only once decrypted, which is the connection's business
    problem = openssh_damage(body) if label == "OPENSSH PRIVATE KEY" else der_damage(body)
    return f"its {label} body {problem}" if problem else None


def openssh_damage(body: bytes) -> str | None:
    """What is wrong with an `openssh-key-v1` blob's framing (PROTOCOL.key), or None."""
    if not body.startswith(OPENSSH_MAGIC):
        return "does not start with openssh-key-v1"
    at = len(OPENSSH_MAGIC)

    def field(what: str) -> bytes:
        nonlocal at
        if at + 4 > len(body):
            raise ValueError(f"ends before its {what}")
        size = int.from_bytes(body[at : at + 4], "big")
        if at + 4 + size > len(body):
            raise ValueError(f"ends inside its {what} ({len(body) - at - 4} of {size} bytes)")
        at += 4 + size
        return body[at - size : at]

    try:
        for what in ("cipher name", "kdf name", "kdf options"):
            field(what)
        if at + 4 > len(body):
            raise ValueError("ends before its number of keys")
        count = int.from_bytes(body[at : at + 4], "big")
        at += 4
        if not 1 <= count <= 64:
            raise ValueError(f"says it holds {count} keys")
        for index in range(count):
            field(f"public key {index + 1}")
        field("private section")
    except ValueError as exc:
        return f"{exc} (the file was cut short?)"
    return None if at == len(body) else f"has {len(body) - at} bytes after its private section"


def der_damage(body: bytes) -> str | None:
    """What is wrong with a DER blob that should be exactly one SEQUENCE, or None."""
    if body[0] != 0x30:
        return "is not a DER SEQUENCE"
    if len(body) < 2:
        return "ends inside its DER header (the file was cut short?)"
    first = body[1]
    if first < 0x80:
        header, size = 2, first
    else:
        width = first & 0x7F
        if not 1 <= width <= 4 or len(body) < 2 + width:
            return "has a broken DER length (the file was cut short?)"
        header, size = 2 + width, int.from_bytes(body[2 : 2 + width], "big")
    if header + size > len(body):
        return f"ends after {len(body) - header} of its {size} DER bytes (the file was cut short?)"
    return None if header + size == len(body) else f"has {len(body) - header - size} bytes after its DER SEQUENCE"
