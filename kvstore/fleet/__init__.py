"""The fleet: shared metadata on S3, its layouts, fleet-wide lookup, and garbage collection."""
