"""HTTP POST of one JSON object to a webhook (run notifications). Lives with the transports: it is the
controller's only other way of talking to the outside.

The URL is a secret-bearing value (Slack and Discord put the token in the path, others in the query or the
userinfo): it never appears in an error message; callers show `inventory_policy.shown_url(url)`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, payload: dict[str, Any], *, timeout: float) -> str | None:
    """POST `payload`; None when the server answered 2xx, else a short reason (no part of the URL)."""
    body = json.dumps(payload, sort_keys=True).encode()
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "dflashops"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return None if 200 <= answer.status < 300 else f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        return f"{type(reason).__name__}: {getattr(reason, 'strerror', None) or reason}" if not isinstance(
            reason, str) else reason
    except (OSError, ValueError) as exc:
        return type(exc).__name__
