"""Eviction: the policies that pick a full tier's victim, and the resume-hint estimator."""
