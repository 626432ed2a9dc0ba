"""Speech-to-text lines of a batch file (``python -m engine run-batch``): vLLM's
``/v1/audio/transcriptions`` and ``/v1/audio/translations`` lines.

A batch line is JSON, so its clip cannot be the multipart upload the server's route takes:
as in vLLM's run-batch, the body names it by ``file_url`` (a base64 ``data:`` URL, or an
http(s) URL of a host ``--allowed-media-domains`` lets in; no other scheme) and its other
fields are the route's form fields (``model``, ``language``, ``prompt``,
``response_format``, ``temperature``, ``timestamp_granularities``, the sampling extras).
:func:`speech_form` turns such a body into the multipart form the route reads, so the line
meets the server's own validation and answer. A ``file`` field is refused, naming it.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from engine.errors import InvalidParamError
from engine.multimodal import media_url_bytes

SPEECH_URLS = ("/v1/audio/transcriptions", "/v1/audio/translations")
# The form's name of the list field; a JSON body may give it under either name.
_GRANULARITIES = "timestamp_granularities[]"
# A field name the form can carry as it is (no quote or line break to escape).
_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]]+")


def speech_form(body: dict[str, Any], allowed_domains: tuple[str, ...]) -> tuple[bytes, str]:
    """The multipart/form-data body (and its content type) of a speech line's JSON ``body``:
    the clip ``file_url`` names as ``file``, every other field as a form field (``true`` /
    ``false`` for booleans, a list as the field repeated). Blocking where ``file_url`` is
    fetched; raises :class:`InvalidParamError` naming the field at fault."""
    if "file" in body:
        raise InvalidParamError("a batch line names its clip by `file_url` (a data: URL, or an "
                                "http(s) URL of an allowed host); `file` is not taken", param="file")
    url = body.get("file_url")
    if not isinstance(url, str) or not url:
        raise InvalidParamError("`file_url` is missing: a batch line names its clip by a data: URL, "
                                "or an http(s) URL of an allowed host", param="file_url")
    clip = media_url_bytes(url, "file_url", "file_url", allowed_domains)
    fields: list[tuple[str, str]] = []
    for key, value in body.items():
        if key == "file_url":
            continue
        name = _GRANULARITIES if key == "timestamp_granularities" else key
        if not _NAME.fullmatch(name):
            raise InvalidParamError(f"unknown or unsupported field {name!r}", param=name)
        for item in value if isinstance(value, list) else [value]:
            fields.append((name, _form_value(item)))
    return _multipart(fields, clip)


def _form_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value)  # a number as JSON writes it; anything else, for the route to refuse


def _multipart(fields: list[tuple[str, str]], clip: bytes) -> tuple[bytes, str]:
    boundary = f"batch-{uuid.uuid4().hex}"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="clip"\r\n'
                 "Content-Type: application/octet-stream\r\n\r\n".encode() + clip + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


__all__ = ["SPEECH_URLS", "speech_form"]
