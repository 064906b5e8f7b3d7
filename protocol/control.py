"""Control messages between the launcher and its children, both ways."""

from .fields import Int, Opt, Str, wire
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


@message
class ModelLoadFailed:
    """The launcher tells the front end that a model's load failed (its worker or
    scheduler died before joining, or its folder no longer resolves): `reason` says
    why, for the requests waiting for it and `/v1/models`."""

    TAG = 3
    model: str = wire(Str(max_len=256))
    reason: str = wire(Str(max_len=4096))


@message
class EngineUnresponsive:
    """The front end tells the launcher that an engine's link went silent past
    --worker-timeout (its scheduler is stopped or hung): its requests went on
    elsewhere, and the launcher replaces the engine."""

    TAG = 4
    engine: str = wire(Str(max_len=256))
    pid: int = wire(Int(minimum=0))   # its scheduler's, as it joined (SchedulerReady)
