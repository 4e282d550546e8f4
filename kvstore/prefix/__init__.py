"""Prefix reuse: the chain index over stored blocks, and retention of unreferenced chunks."""
