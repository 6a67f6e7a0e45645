"""Benchmarks: programs that print a table and write JSON, each against a baseline measured in the same run."""
