"""Encryption at rest: the sealed value format, sealing tiers, and the census of sealed data."""
