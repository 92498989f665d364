"""HTTP POST of one JSON object to a webhook (run notifications). Lives with the transports: it is the
controller's only other way of talking to the outside.

The URL is a secret-bearing value (Slack and Discord put the token in the path, others in the query or the
userinfo): it never appears in an error message; callers show `inventory_policy.shown_url(url)`.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def split_userinfo(url: str) -> tuple[str, dict[str, str]]:
    """(the URL without `user:password@`, the Basic Authorization header it stood for): urllib would
    otherwise take the userinfo for part of the host name."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, {}
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port:
        netloc += f":{parts.port}"
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), {"Authorization": f"Basic {token}"}


def post_json(url: str, payload: dict[str, Any], *, timeout: float) -> str | None:
    """POST `payload`; None when the server answered 2xx, else a short reason (no part of the URL)."""
    body = json.dumps(payload, sort_keys=True).encode()
    url, auth = split_userinfo(url)
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "dflashops", **auth}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return None if 200 <= answer.status < 300 else f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        return (
            f"{type(reason).__name__}: {getattr(reason, 'strerror', None) or reason}"
            if not isinstance(reason, str)
            else reason
        )
    except (OSError, ValueError) as exc:
        return type(exc).__name__
