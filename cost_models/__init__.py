"""Compute, communication, memory and pipeline cost models (issue #4); nothing is implemented here yet."""
