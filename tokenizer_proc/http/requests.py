"""From an HTTP body to the core's GenerateRequests: the parameters the core takes
(protocol/sampling.py's names), and back from the core's errors to the body's names."""

from mlxd.protocol import ErrorReply, GenerateRequest

from .errors import ApiError, bad_request
from .openai_schema import PASSED


def core_params(body, max_tokens: int | None, **extra) -> dict:
    """The core's params for an OpenAI body: what it sent of PASSED, `max_tokens`,
    `n` (left out when 1, the default), `logit_bias` with token-id keys, and `extra`
    (a body without `n` or `logit_bias`, the Responses API's, sends neither)."""
    params = {name: getattr(body, name) for name in PASSED if getattr(body, name) is not None}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    n, bias = getattr(body, "n", None), getattr(body, "logit_bias", None)
    if n is not None and n != 1:
        params["n"] = n
    if bias is not None:
        params["logit_bias"] = token_keyed(bias)
    params.update({k: v for k, v in extra.items() if v is not None})
    return params


def token_keyed(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias has token ids as JSON object keys, so as strings."""
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from None


def choices_per_request(body) -> int:
    if body.n is not None and body.n < 1:
        raise bad_request(f"n must be at least 1, got {body.n}", "n")
    return body.n or 1


def generate_requests(inputs: list[dict], params: dict, stream: bool) -> list[GenerateRequest]:
    """One request per input (its `prompt`, `messages` or `input_ids`), rid = its index."""
    return [GenerateRequest(str(i), params=params, stream=stream, **given)
            for i, given in enumerate(inputs)]


def core_error(reply: ErrorReply, renamed: dict[str, str]) -> ApiError:
    """The core refused a request: 400 naming the parameter it names (`renamed` maps
    core names, and `prompt`, to the body's), 500 if it failed."""
    if reply.code != "invalid_request":
        return ApiError(500, f"{reply.code}: {reply.message}")
    return bad_request(reply.message, renamed.get(reply.param, reply.param))
