"""Compaction: the offline (and beside-a-live-server) job, and the disk-tier pieces it drives."""
