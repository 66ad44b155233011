"""Tests: the checkpoint wrapper, against plain torch and the peers' wrappers."""
