"""Placeholder: filled in by the conv op family."""
