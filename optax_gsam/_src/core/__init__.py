"""Shared by every concern: dtypes and arrays, argument checks, keyword groups."""
