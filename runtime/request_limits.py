"""How long a request may be: the one rule the tokenizer and the scheduler share.

A request of `n` prompt tokens generates at most `max_tokens`, clamped to what the
model's context leaves (n + generated <= max_context). Its KV takes a pool slot per
prompt token and per generated token but the last (whose KV is never computed). It is
accepted only if the prompt is shorter than the context and the pool, and its KV at
the clamped max_tokens fits in the pool: a request bigger than the pool would
otherwise run alone until the pool is full and fail there. Pure: no sockets, no MLX.
"""


def max_new_tokens(n: int, max_tokens: int, max_context: int) -> int:
    """Tokens a request of `n` prompt tokens may generate: max_tokens, clamped so
    prompt and output fit the model's context."""
    return min(max_tokens, max_context - n)


def kv_slots(n: int, generated: int) -> int:
    """Pool slots a request of `n` prompt tokens holds once it generated `generated`."""
    return n + max(generated - 1, 0)


def length_error(n: int, max_tokens: int, max_context: int, kv_capacity: int) -> str | None:
    """Why a request of `n` prompt tokens and `max_tokens` is refused, or None."""
    if n >= max_context:
        return f"the prompt has {n} tokens; the model's context is {max_context} tokens"
    if n >= kv_capacity:
        return f"the prompt has {n} tokens; the KV cache holds {kv_capacity} tokens"
    new = max_new_tokens(n, max_tokens, max_context)
    if kv_slots(n, new) > kv_capacity:
        return (f"the prompt has {n} tokens and max_tokens allows {new} more; the KV "
                f"cache holds {kv_capacity} tokens: lower max_tokens to at most "
                f"{kv_capacity - n + 1}")
    return None


MAX_RESUMES = 1   # a request running at a second process death is not resumed again


def resume_refusal(resumes: int, cause: str) -> str | None:
    """Why a request that was running when `cause` happened (a process death) ends
    with an error instead of going on elsewhere, or None. One resumed already was
    running at two deaths in a row: it may be what kills them (an out-of-memory
    prefill), and resuming it again could crash-loop the server."""
    if resumes < MAX_RESUMES:
        return None
    return (f"{cause}; the request was running at {resumes + 1} failures in a row "
            "(process deaths or failed steps) and is not resumed again: it may be their "
            "cause")
