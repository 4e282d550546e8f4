"""Server coordination for ``kvtier compact`` (``services.compact`` is the command)."""
