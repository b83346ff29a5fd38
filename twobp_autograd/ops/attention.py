"""Placeholder: filled in by the attention op family."""
