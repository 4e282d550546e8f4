"""Integrations of kvtier with model libraries.

``kvtier.integrations.transformers``: spill and resume a Hugging Face transformers cache
(``DynamicCache`` of a standard model; DeepseekV4's compressed caches with bounded replay).
Needs the optional dependency: ``pip install 'kvtier[transformers]'``.
"""
