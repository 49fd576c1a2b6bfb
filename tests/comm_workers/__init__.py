"""Functions and entry points run inside the ranks started by tests/test_dist.py."""
