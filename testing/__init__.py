"""Test harness: simulated and faulty filesystems, and the power-loss campaign. Not shipped."""
