"""Every message exchanged between mlxd processes, grouped by the receiver."""

from .codec import Decoder, ProtocolError, encode
from .control import Ready
from .to_client import ErrorReply, StatsReply, StreamChunk
from .to_scheduler import Abort, GetStats, StepResult, TokenizedRequest, WorkerError
from .to_tokenizer import (
    AbortRequest, GenerateRequest, Stats, StatsRequest, TokenBatch, TokenEntry,
)
from .to_worker import PrefillInput, SamplingParams, Step

__all__ = [
    "Abort", "AbortRequest", "Decoder", "ErrorReply", "GenerateRequest", "GetStats",
    "PrefillInput", "ProtocolError", "Ready", "SamplingParams", "Stats", "StatsReply",
    "StatsRequest", "Step", "StepResult", "StreamChunk", "TokenBatch", "TokenEntry",
    "TokenizedRequest", "WorkerError", "encode",
]
