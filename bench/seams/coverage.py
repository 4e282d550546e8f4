"""What the simulation drives: every RPC of ``proto/kvtier.proto`` (both services) and
every ``kvtier`` subcommand (``services.cli.main.COMMANDS``), each mapped to an operation
(``engine.WEIGHTS``), a maintenance event (``engine.EVENTS``) or the run's last step
(``engine.FINAL``) that calls it. ``tests/architecture/test_simulation_coverage.py``
fails when an RPC or a subcommand is in neither ``COVERS`` nor ``EXEMPT``, or when
``COVERS`` names an operation the engine does not have.
"""

from __future__ import annotations

COVERS = {
    "rpc:KVTier.Spill": "spill-new",
    "rpc:KVTier.Restore": "restore",
    "rpc:KVTier.Resume": "resume",
    "rpc:KVTier.Prefetch": "prefetch",
    "rpc:KVTier.Evict": "evict",
    "rpc:KVTier.Delete": "delete",
    "rpc:KVTier.Stat": "stat-session",
    "rpc:KVTier.List": "count",
    # the client's shared-memory path (loopback): every spill's and restore's payloads
    "rpc:KVTier.LeaseSegment": "spill-new",
    "rpc:KVTier.ReleaseSegments": "restore",
    "rpc:KVTier.Lookup": "lookup-spill",
    "rpc:KVTier.Fork": "fork",
    "rpc:KVTier.WriteChunks": "write-chunks",
    "rpc:KVTier.ReadChunks": "read-chunks",
    "rpc:KVTier.RegisterLayout": "register",
    "rpc:KVTier.ListLayouts": "list-layouts",
    "rpc:Replay.Rebuild": "remote-replay",
    "cli:layouts": "cli-tools",
    "cli:serve": "restart",
    "cli:replay-worker": "remote-replay",
    "cli:stat": "cli-tools",
    "cli:top": "cli-tools",
    "cli:health": "cli-tools",
    "cli:reload": "cli-tools",
    "cli:list": "cli-tools",
    "cli:lookup": "cli-tools",
    "cli:fork": "cli-tools",
    "cli:generate": "cli-tools",
    "cli:compact": "compact-offline",
    "cli:repair": "repair",
    "cli:fleet-gc": "compact-live",
    "cli:backup": "backup",
    "cli:restore-backup": "backup",
    "cli:migrate": "migrate",
    "cli:certs": "cli-tools",
    "cli:keygen": "cli-tools",
    "cli:init": "cli-tools",
    "cli:drain": "drain",
    "rpc:KVTier.Drain": "drain",
    "rpc:KVTier.AdoptWindow": "drain",  # a fleet drain's moves, and hostile calls to it
    "cli:rekey": "rekey",  # and keygen --rotate

}

# What the simulation cannot drive, and why (kept minimal: each is a promise no
# simulated crossing checks).
EXEMPT = {
    "cli:demo": "runs its own embedded server over its own directory and measures the "
                "bundled model's agreement: it calls nothing of the simulated service "
                "(tests/cli/test_demo.py runs it end to end)",
}
