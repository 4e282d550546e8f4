"""The whole-service simulation: seeded, model-based, over real ``kvtier serve``
processes with every crossing of the feature switches (``bench.seams.switches``).

Modules: ``world`` (the real processes: redis-server, moto's S3 server, tmpfs, the
server and the CLI tools), ``switches`` (combinations and their configs), ``model`` (the
reference model of every session), ``verdict`` (failure keys and findings), ``ops`` (the
client operations, judged), ``maintenance`` (restarts, compaction, repair, migrate, a
full medium), ``engine`` (one combination's run), ``run`` (the whole run), ``probe``
(the fallback stall probe). ``python -m bench.seams --json`` runs it.
"""
