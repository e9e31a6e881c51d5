"""Several requests decoded together: one target pass verifies every sequence's block."""
