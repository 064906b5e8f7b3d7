"""Control messages between the launcher and its children."""

from .fields import Opt, Str, wire
from .message import message


@message
class Ready:
    """A process is up (to the launcher). The tokenizer's carries its client address,
    its HTTP API's bound address (`http://HOST:PORT`) and, with `--engine-port`, the
    address engines on other machines join."""

    TAG = 1
    process: str = wire(Str())
    address: str | None = wire(Opt(Str()), default=None)
    http_address: str | None = wire(Opt(Str()), default=None)
    engine_address: str | None = wire(Opt(Str()), default=None)   # where engines join


MODEL_ACTIONS = ("load", "unload")


@message
class ModelControl:
    """The front end asks the launcher to start (`load`) or stop (`unload`) the
    engines of a served model (by its name in the catalog)."""

    TAG = 2
    action: str = wire(Str(choices=MODEL_ACTIONS))
    model: str = wire(Str(max_len=256))
