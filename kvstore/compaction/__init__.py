"""The offline jobs over a data directory: compaction and index repair. They orchestrate;
the disk-tier primitives they drive live in ``kvstore.tiers.disk``."""
