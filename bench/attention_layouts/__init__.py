"""Decode-attention layouts measured against each other: one attention layer's
decode step (one query per row) over ragged, shared-prefix and joining batches.
Run `python -m bench.attention_layouts --help`; see docs/PERFORMANCE.md,
"Decode attention layouts"."""
