"""worker: TODO docstring."""
