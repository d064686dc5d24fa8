"""Datasets of the reference workloads (Tiny Shakespeare ships inside the package)."""
