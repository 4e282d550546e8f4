"""transformers model families in kvtier's terms: the cache layers transformers builds for
a config (``attention``), the layout of a model's cache (``layouts``), its values in a
layout's streams (``quant``), and DeepseekV4's cache classes to and from streams with
bounded replay (``deepseek_v4``).

Shared by the client integration (``kvtier.integrations.transformers``) and the replay
worker (``replay.transformers_worker``), which may not import each other; ``attention``,
``layouts`` and ``deepseek_v4`` import transformers, ``quant`` does not.
"""
