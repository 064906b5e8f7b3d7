"""Model folders mlxd can serve: the built-in demo model, and (later) converters."""
