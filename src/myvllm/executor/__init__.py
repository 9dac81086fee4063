"""executor: TODO docstring."""
