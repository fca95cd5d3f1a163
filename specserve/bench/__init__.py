"""Benchmarks: scripts that print a table and write JSON. Speed is reported as ratios measured side by side."""
