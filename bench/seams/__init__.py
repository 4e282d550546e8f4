"""The whole-service simulation: seeded, model-based, over real ``kvtier serve``
processes with every crossing of the feature switches (``bench.seams.switches``).

Modules: ``world`` (the real processes: redis-server, moto's S3 server, tmpfs, the
server and the CLI tools), ``switches`` (combinations and their configs), ``model`` (the
reference model of every session), ``verdict`` (failure keys and findings), ``ops`` (the
client operations, judged), ``layouts`` (valid and hostile registrations),
``maintenance`` (restarts, compaction, repair, migrate, a full medium), ``engine`` (one
combination's run), ``run`` (the whole run), ``probe`` (the fallback stall probe),
``report`` (its REPORT.md section). ``python -m bench.seams --json`` runs it.

To extend it: an operation is an ``Ops`` method that calls the client and judges the
reply against the model (``ops.py``), a weight in ``engine.WEIGHTS`` and a branch of
``Simulation._pick``; a maintenance event is a branch of ``maintenance.event`` and a
name in ``engine.EVENTS``; a switch is a field of ``switches.Combination`` and its lines
in ``switches.write_config``.
"""
