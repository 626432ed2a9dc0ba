"""Server-sent events as OpenAI frames them: ``data: {json}\\n\\n`` and a final ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Proxies (nginx) buffer responses by default; these headers keep tokens flowing.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, the way OpenAI's servers write it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def event(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"
