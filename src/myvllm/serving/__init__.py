"""serving: TODO docstring."""
