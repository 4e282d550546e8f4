"""The fleet: shared metadata on S3, its layouts, and garbage collection."""
