"""``--kv-transfer-config``: vLLM's KV connector settings, as this engine takes them.

vLLM moves computed KV between engines through a *connector* named in a JSON object
(``KVTransferConfig``). This engine has one connector, a shared folder of prompt blocks
(:mod:`engine.runner.kv_store`), under vLLM's names for its folder connector,
``ExampleConnector`` (formerly ``SharedStorageConnector``)::

    --kv-transfer-config '{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": "/data/kv"}}'

``kv_role`` says what the engine does with the folder: ``kv_producer`` writes the full
blocks of every prompt it computes, ``kv_consumer`` reads the blocks a new prompt starts
with instead of computing them, ``kv_both`` does both. The connectors that move KV over a
network (NIXL, Mooncake, P2P NCCL, LMCache, ...) are refused by name, as are the keys
that would change what the engine does and are not built; keys that only configure
another connector's transport (ports, addresses, buffer sizes) are accepted and unused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from engine.errors import ConfigError

FIELD = "kv_transfer_config"
# vLLM's names of its folder connector (renamed from SharedStorageConnector in 2025).
CONNECTORS = ("ExampleConnector", "SharedStorageConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_STORAGE_PATH = "/tmp"  # vLLM's default shared_storage_path
# Keys of vLLM's KVTransferConfig that only configure other connectors' transport.
_TRANSPORT_KEYS = frozenset({"engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank",
                             "kv_parallel_size", "kv_ip", "kv_port"})
# Keys that would change what happens, accepted at vLLM's defaults only.
_DEFAULT_ONLY = {"kv_connector_module_path": None, "enable_permute_local_kv": False,
                 "kv_load_failure_policy": "recompute"}


@dataclasses.dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """The checked form: the connector's name, the role, and the folder (absolute)."""

    kv_connector: str
    kv_role: str
    shared_storage_path: str

    @property
    def saves(self) -> bool:
        """The engine writes the prompt blocks it computes to the folder."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        """The engine reads a new prompt's leading blocks from the folder."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def to_json(self) -> str:
        return json.dumps({"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                           "kv_connector_extra_config": {"shared_storage_path": self.shared_storage_path}},
                          sort_keys=True)


def _bad(message: str) -> ConfigError:
    return ConfigError(f"{FIELD}: {message}", field=FIELD)


def parse_kv_transfer_config(value: dict[str, Any]) -> KVTransferConfig:
    """The checked :class:`KVTransferConfig` of vLLM's JSON object (decoded: the flag's text
    is decoded by ``EngineConfig``); anything this engine cannot honour raises
    :class:`ConfigError` naming ``kv_transfer_config``."""
    known = {"kv_connector", "kv_role", "kv_connector_extra_config", *_TRANSPORT_KEYS, *_DEFAULT_ONLY}
    unknown = sorted(set(value) - known)
    if unknown:
        raise _bad(f"unknown key(s) {', '.join(unknown)}")
    connector = value.get("kv_connector")
    if connector not in CONNECTORS:
        raise _bad(f"kv_connector {connector!r} is not built here: the one connector is a shared "
                   f"folder of KV blocks, named {' or '.join(CONNECTORS)}")
    role = value.get("kv_role")
    if role not in ROLES:
        raise _bad(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")
    for key, default in _DEFAULT_ONLY.items():
        if key in value and value[key] != default:
            raise _bad(f"{key}={value[key]!r} is not supported (only {default!r}): a block that "
                       "cannot be read is computed again")
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise _bad(f"kv_connector_extra_config must be a JSON object, got {extra!r}")
    unknown = sorted(set(extra) - {"shared_storage_path"})
    if unknown:
        raise _bad(f"unknown kv_connector_extra_config key(s) {', '.join(unknown)} ({connector} "
                   "reads shared_storage_path)")
    path = extra.get("shared_storage_path", DEFAULT_STORAGE_PATH)
    if not isinstance(path, str) or not path:
        raise _bad(f"shared_storage_path must be a folder, got {path!r}")
    return KVTransferConfig(connector, role, os.path.abspath(os.path.expanduser(path)))
