"""Where blocks live: the tier stack, key locks, reference counts, write-back, durability."""
