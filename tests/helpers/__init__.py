"""Helpers shared by the test modules (composing configs, checking a run folder's outputs)."""
