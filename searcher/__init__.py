"""Intra-op ILP and inter-op DP plan search (issue #5); nothing is implemented here yet."""
