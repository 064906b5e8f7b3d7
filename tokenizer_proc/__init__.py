"""The tokenizer process: the client-facing socket, text in, text out."""
