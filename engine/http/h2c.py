"""Cleartext HTTP/2 (h2c) only when ``serve --enable-h2c`` asks for it.

hypercorn serves HTTP/2 over TLS (ALPN ``h2``) and, on a plain TCP port, also HTTP/2
"with prior knowledge" (a connection that opens with the ``PRI * HTTP/2.0`` preface) and
the HTTP/1.1 ``Upgrade: h2c`` dance; it has no setting to turn the cleartext two off. The
documented server speaks HTTP/1.1 in cleartext and HTTP/2 with TLS, so unless the flag is
given: a prior-knowledge connection gets an HTTP/1.1 ``505 HTTP Version Not Supported``
and is closed, and an ``Upgrade: h2c`` request is answered in HTTP/1.1 (a server may
ignore an Upgrade header, RFC 9110 section 7.8). HTTP/2 with TLS is unchanged.

:func:`configure` marks a hypercorn ``Config``; the two patched hypercorn methods read the
mark, so servers with and without the flag can share a process (the tests' servers do).
"""

from __future__ import annotations

from typing import Any

from hypercorn.events import Closed, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H2ProtocolAssumedError, H11Protocol

# The attribute of a hypercorn Config that says whether h2c is served. A Config without it
# (a hypercorn server this module did not set up) keeps hypercorn's behaviour.
_ATTRIBUTE = "engine_enable_h2c"
_BODY = b"HTTP/2 without TLS is not enabled on this server (serve --enable-h2c)\n"
REFUSAL = (b"HTTP/1.1 505 HTTP Version Not Supported\r\ncontent-type: text/plain\r\n"
           b"content-length: " + str(len(_BODY)).encode() + b"\r\nconnection: close\r\n\r\n"
           + _BODY)


def configure(config: Any, *, enable_h2c: bool) -> None:
    """Serve cleartext HTTP/2 on ``config``'s server only with ``enable_h2c``."""
    setattr(config, _ATTRIBUTE, enable_h2c)
    _patch_hypercorn()


def _enabled(config: Any) -> bool:
    return bool(getattr(config, _ATTRIBUTE, True))


def _patch_hypercorn() -> None:
    """Idempotent; see the module docstring."""
    if getattr(ProtocolWrapper.handle, "engine_h2c", False):
        return
    check_protocol = H11Protocol._check_protocol
    handle = ProtocolWrapper.handle

    async def checked(self: Any, event: Any) -> None:
        if not _enabled(self.config) and any(
                name.strip().lower() == b"upgrade" and value.strip().lower() == b"h2c"
                for name, value in event.headers):
            return  # answered as the HTTP/1.1 request it also is
        await check_protocol(self, event)

    async def handled(self: Any, event: Any) -> None:
        if _enabled(self.config):
            return await handle(self, event)
        try:
            return await self.protocol.handle(event)
        except H2ProtocolAssumedError:
            await self.send(RawData(data=REFUSAL))
            await self.send(Closed())

    handled.engine_h2c = True  # type: ignore[attr-defined]
    H11Protocol._check_protocol = checked  # type: ignore[method-assign]
    ProtocolWrapper.handle = handled  # type: ignore[method-assign]
