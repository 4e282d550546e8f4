"""The whole-service simulation: seeded, model-based, over real ``kvtier serve``
processes with every crossing of the feature switches (``bench.seams.switches``).

Modules: ``world`` (the real processes: redis-server, moto's S3 server, tmpfs, the
server and the CLI tools), ``switches`` (combinations and their configs), ``model`` (the
reference model of every session), ``verdict`` (failure keys and findings), ``ops`` (the
client operations on sessions, judged: spills, restores and resumes with or without a
stated model fingerprint, forks, deletes, evictions, prefetches, Stat, List, layouts),
``prefix`` (prefix chunks of no session: WriteChunks, ReadChunks, Lookup, and their
model), ``layouts`` (valid and hostile registrations), ``lives`` (a server stopped
and started, the model told), ``maintenance`` (restarts,
kill -9, compaction, repair, migrate, a full medium), ``backups`` (backup and
restore-backup, with damage), ``operator`` (the online subcommands, certs and keygen,
the live tokens file, a routed client with a hung node, a remote replay worker),
``coverage`` (which operation drives each RPC and subcommand), ``engine`` (one
combination's run), ``run`` (the whole run), ``probe`` (the fallback stall probe),
``report`` (its REPORT.md section). ``python -m bench.seams --json`` runs it.

To extend it: an operation is an ``Ops`` method (or a function of its own module, as
``prefix``'s) that calls the client and judges every reply field that states stored
state against the model, a weight in ``engine.WEIGHTS`` and a branch of
``Simulation._pick``; a maintenance event is a branch of ``maintenance.event`` (or an
entry of ``operator.EVENTS``), a name in ``engine.EVENTS`` and, when it means nothing
for some combinations, a line of ``maintenance.applies``; a switch is a field of
``switches.Combination`` and its lines in ``switches.write_config``. A new RPC or
``kvtier`` subcommand is mapped in ``coverage.COVERS`` to the operation or event that
drives it (``tests/architecture/test_simulation_coverage.py`` fails until it is).
"""
