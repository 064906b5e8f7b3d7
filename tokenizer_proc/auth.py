"""The `--api-key` check, shared by every front end."""

import hmac


def key_matches(expected: str, given: str | None) -> bool:
    """Whether `given` is the server's key; any key does when the server has none.
    Compared in constant time, so response times do not leak the key."""
    if not expected:
        return True
    return hmac.compare_digest(expected.encode(), (given or "").encode())
