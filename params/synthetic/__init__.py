"""Synthetic models: small, data-free configs for tests and smoke runs."""
