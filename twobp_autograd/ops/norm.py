"""Placeholder: filled in by the norm op family."""
