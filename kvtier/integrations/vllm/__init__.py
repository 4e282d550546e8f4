"""kvtier as vLLM's external KV cache: ``KVTierConnector`` (see docs/vllm.md).

Load it with ``KVTransferConfig(kv_connector="KVTierConnector",
kv_connector_module_path="kvtier.integrations.vllm", ...)``. Importing this package loads
vLLM and torch; ``import kvtier`` never imports it.
"""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
