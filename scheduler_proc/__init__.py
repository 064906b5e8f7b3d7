"""The scheduler process: request lifecycle, KV slot bookkeeping, batching policy."""
