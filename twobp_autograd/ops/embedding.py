"""Placeholder: filled in by the embedding op family."""
