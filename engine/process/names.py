"""Models named by Hub id become local paths, once, before anything loads.

:func:`resolve_config` runs :func:`engine.models.hub.resolve_name` on every name of an
:class:`~engine.config.EngineConfig` (``model``, ``tokenizer``, the speculative draft's
``model``) and gives back the config with local paths in their place: engine-core
processes and tensor-parallel workers then load paths only, all from the one commit read
here. ``serve`` calls it before its trio run (a download is interrupted by Ctrl-C like any
blocking call); :func:`engine.open_engine` calls it again, a no-op on paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import ConfigError, ModelLoadError
from engine.models.hub import disk_free, resolve_name
from engine.models.loader import EMBEDDING_MODEL_NAMES


def resolve_config(config: EngineConfig, *, token: str | None = None,
                   endpoint: str | None = None, offline: bool | None = None,
                   free_bytes: Callable[[Path], int] = disk_free) -> EngineConfig:
    """``config`` with its Hub ids resolved to local paths (fetched into
    ``config.download_dir``, the Hugging Face cache by default); ``served_model_name``
    defaults to the model's id, as vLLM names it. ``token``, ``endpoint`` and ``offline``:
    None is huggingface_hub's own reading of ``HF_TOKEN``, ``HF_ENDPOINT`` and
    ``HF_HUB_OFFLINE``. Raises the :class:`~engine.errors.ModelLoadError` family."""
    options: dict[str, Any] = dict(token=token, cache_dir=config.download_dir,
                                   endpoint=endpoint, offline=offline, free_bytes=free_bytes)
    changes: dict[str, Any] = {}
    model = config.model
    # The packaged embedder's names stay with the package (engine.models.loader).
    if model is not None and model not in EMBEDDING_MODEL_NAMES:
        found = resolve_name(model, revision=config.revision, **options)
        if found.name is not None:
            changes["model"] = str(found.path)
            if config.served_model_name is None:
                changes["served_model_name"] = model
    if config.tokenizer is not None:
        found = resolve_name(config.tokenizer, revision=config.tokenizer_revision,
                             tokenizer_only=True, **options)
        changes["tokenizer"] = str(found.path)
    spec = config.speculative
    if spec is not None and spec.model is not None:
        try:
            found = resolve_name(spec.model, **options)
        except ModelLoadError as exc:  # named as the draft's other refusals are (rank.py)
            raise ConfigError(f"speculative_config: model {spec.model!r} cannot be loaded as "
                              f"the draft: {exc}", field="speculative_config") from exc
        if found.name is not None:
            draft = dataclasses.replace(spec, model=str(found.path))
            changes["speculative_config"] = draft.to_json()
    return dataclasses.replace(config, **changes) if changes else config
