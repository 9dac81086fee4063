"""structured_output: TODO docstring."""
