"""Every message exchanged between mlxd processes, grouped by the receiver."""

from .codec import Decoder, ProtocolError, encode
from .control import Ready
from .to_client import ErrorReply, StreamChunk
from .to_scheduler import Abort, StepResult, TokenizedRequest, WorkerError
from .to_tokenizer import AbortRequest, GenerateRequest, TokenBatch, TokenEntry
from .to_worker import PrefillInput, SamplingParams, Step

__all__ = [
    "Abort", "AbortRequest", "Decoder", "ErrorReply", "GenerateRequest",
    "PrefillInput", "ProtocolError", "Ready", "SamplingParams", "Step", "StepResult",
    "StreamChunk", "TokenBatch", "TokenEntry", "TokenizedRequest", "WorkerError", "encode",
]
