"""sample: TODO docstring."""
