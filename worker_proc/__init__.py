"""The MLX worker process: holds the model, the slot-indexed KV pool and all MLX state."""
