"""Prefix reuse: the chain index over stored blocks, retention of unreferenced chunks, and
the lookup that asks a fleet's shared tiers."""
