"""Calls to remote dependencies: deadlines, and one circuit breaker per dependency."""
