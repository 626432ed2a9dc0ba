"""Bearer-token check for ``--api-key``."""

from __future__ import annotations

import hmac

# Probes and scrapers must work without the key, as in vLLM.
# /load too: a load balancer polls it like /health.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/load"})


def authorized(api_key: str | None, path: str, authorization: str | None) -> bool:
    """Whether a request may go through.

    The comparison runs in constant time (``hmac.compare_digest``) so the response time
    does not leak how many leading bytes of a guessed key were right.
    """
    if api_key is None or path in OPEN_PATHS:
        return True
    expected = b"Bearer " + api_key.encode()
    return hmac.compare_digest((authorization or "").encode(), expected)


def key_matches(api_key: str | None, x_api_key: str | None) -> bool:
    """Whether an ``x-api-key`` header (Anthropic's clients send the key there) holds the
    server's key; constant time, as :func:`authorized`."""
    if api_key is None or x_api_key is None:
        return False
    return hmac.compare_digest(x_api_key.encode(), api_key.encode())
