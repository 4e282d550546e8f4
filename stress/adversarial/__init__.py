"""The adversarial campaign: named attacks, each against a live server and replay worker.

Modules: ``cases`` (attacks on spills, chunks, shared memory, ids and streams),
``layouts`` (attacks on run-time layouts and prefix reuse), ``campaign`` (the run and its
runner), ``report`` (its REPORT.md section)."""
