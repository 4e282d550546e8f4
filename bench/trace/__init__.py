"""The trace benchmark: a tier and eviction-policy simulator replaying a request trace.

Modules: ``reader`` (Mooncake traces), ``workload`` (the calls an engine makes),
``sim`` (the tier simulation), ``policies`` and ``belady`` (what it compares), ``check``
and ``manager_check`` (the simulation against the real TierStack and TierManager),
``compare`` (goals, libCacheSim), ``method`` (how each figure is obtained), ``lookup``
(a Lookup's cost), ``libcachesim`` (libCacheSim's side, run apart), ``run`` (the run and
its runner, ``python -m bench.trace``), ``report`` (its REPORT.md section)."""
