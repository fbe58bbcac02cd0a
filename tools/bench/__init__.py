"""Sections of tools/benchmark.py; see that file for how to run them."""
