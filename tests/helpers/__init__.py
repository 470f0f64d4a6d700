"""Shared helpers for the prefixd test suite."""
