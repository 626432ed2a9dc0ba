"""The engine's version: the one place it is read.

pyproject.toml's ``version`` is the source; an installed package (editable included) carries
it in its metadata. Every reader goes through :data:`VERSION`: ``python -m engine
--version``, the HTTP ``/version`` route, and the :class:`~engine.messages.CoreHello` an
engine core announces itself with (a front end refuses a core of another version).
"""

from __future__ import annotations

import importlib.metadata


def _installed_version() -> str:
    try:
        return importlib.metadata.version("engine")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown"


VERSION = _installed_version()
