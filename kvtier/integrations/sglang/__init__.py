"""kvtier as SGLang's HiCache L3 storage: ``kvtier.integrations.sglang.storage.KVTierStorage``
(README "Using it with SGLang"). Nothing is imported here, so the parts that need no SGLang
(``pages``, ``config``) import without it."""
