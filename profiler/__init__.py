"""Per-operator and collective profiling (issue #3); nothing is implemented here yet."""
