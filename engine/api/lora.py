"""The LoRA adapters an engine serves by name: those of ``--lora-modules`` (checked when the
engine opens) and those loaded and unloaded at runtime.

An adapter is a local folder or a Hugging Face Hub id (``ORG/NAME``): an id is fetched
into the Hub cache (:func:`engine.models.hub.resolve_name` with ``adapter=True``: the
adapter's two files only, the cache first when offline) in the same worker thread that
reads the adapter, and the request then carries the cached folder.

A request names an adapter; admission turns the name into the
:class:`engine.messages.LoraAdapter` (name, folder, id) that travels with it to the runner,
which reads the folder itself. Unloading takes the name away from new requests only: the
requests that already run with it hold their own copy and finish. Loading it again gets a
new id, so nothing cached under the old weights (runner copies, prefix-cache blocks) is
reused.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import trio

from engine.config import EngineConfig, LoraModule
from engine.errors import LoraAdapterError, ModelLoadError, UnknownLoraAdapterError
from engine.messages import LoraAdapter
from engine.models.hub import parse_name, resolve_name
from engine.models.lora import read_lora_adapter


def adapter_folder(name: str, path: str, *, cache_dir: str | None = None, token: str | None = None) -> str:
    """The local folder of adapter ``name`` given as ``path``: itself, or where the Hub id
    ``path`` is cached (fetched first unless offline). Blocking; raises
    :class:`LoraAdapterError` naming the adapter and the reason."""
    try:
        if parse_name(path) is None:
            return path  # an existing local path
    except ModelLoadError:
        return path  # neither a path nor a Hub id: read_lora_adapter says it is no folder
    try:
        return str(resolve_name(path, cache_dir=cache_dir, token=token, adapter=True).path)
    except ModelLoadError as exc:
        raise LoraAdapterError(name, str(exc)) from None


@dataclasses.dataclass(frozen=True, slots=True)
class ServedAdapter:
    adapter: LoraAdapter
    parent: str  # the model /v1/models names as its parent
    source: str = ""  # the path or Hub id as given (/v1/models' root); the adapter's folder if empty


class LoraRegistry:
    """Adapter names to adapters, for admission and /v1/models."""

    def __init__(self, config: EngineConfig, model_config: Any, served_name: str) -> None:
        self.enabled = config.enable_lora
        self._modules = config.lora_module_specs
        self._max_rank = config.max_lora_rank
        self._model_config = model_config
        self._served_name = served_name
        self._base_names = {served_name, *config.served_model_names}  # the base model's
        self._adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)
        self._loading: set[str] = set()
        self._cache_dir = config.download_dir
        # open_engine's hf_token (the command line's --hf-token is HF_TOKEN already).
        self.hub_token: str | None = None

    async def open(self) -> None:
        """Serve ``--lora-modules``, each read and checked in a worker thread; raises
        :class:`LoraAdapterError` for the first bad one (the engine does not start)."""
        for module in self._modules:
            await self._add(module)

    def __iter__(self):
        return iter(tuple(self._adapters.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def resolve(self, name: str | None) -> LoraAdapter | None:
        """The adapter a request names (None: the base model); raises
        :class:`UnknownLoraAdapterError`."""
        if name is None or name in self._base_names:
            return None
        served = self._adapters.get(name)
        if served is None:
            raise UnknownLoraAdapterError(name, "no adapter of that name is served"
                                          + ("" if self.enabled else " (the engine runs without --enable-lora)"),
                                          param="lora")
        return served.adapter

    async def load(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter in ``path`` (a folder or a Hub id) in a worker thread
        (the event loop and the running steps go on), then serve it as ``name``. Raises
        :class:`LoraAdapterError` (nothing changes)."""
        if not self.enabled:
            raise LoraAdapterError(name, "the engine runs without --enable-lora", param="lora_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LoraAdapterError(str(name), "lora_name and lora_path must be non-empty strings",
                                   param="lora_name")
        return await self._add(LoraModule(name, path))

    async def _add(self, module: LoraModule) -> LoraAdapter:
        name = module.name
        if name in self._base_names:
            raise LoraAdapterError(name, "the name is the base model's", param="lora_name")
        if name in self._adapters or name in self._loading:
            raise LoraAdapterError(name, "an adapter of that name is already loaded", param="lora_name")
        self._loading.add(name)
        try:
            folder = await trio.to_thread.run_sync(self._read, module)
        finally:
            self._loading.discard(name)
        adapter = LoraAdapter(name, folder, next(self._ids))
        self._adapters[name] = ServedAdapter(adapter, module.base_model_name or self._served_name, module.path)
        return adapter

    def _read(self, module: LoraModule) -> str:
        folder = adapter_folder(module.name, module.path, cache_dir=self._cache_dir, token=self.hub_token)
        read_lora_adapter(folder, module.name, self._model_config, self._max_rank)
        return folder

    def unload(self, name: str) -> None:
        """Stop serving ``name`` to new requests (those running with it finish); raises
        :class:`UnknownLoraAdapterError`."""
        if self._adapters.pop(name, None) is None:
            raise UnknownLoraAdapterError(name, "no adapter of that name is loaded", param="lora_name")


__all__ = ["LoraRegistry", "ServedAdapter", "adapter_folder"]
