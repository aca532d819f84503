"""Compression methods, one per file; see registry.py."""
