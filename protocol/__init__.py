"""Every message exchanged between mlxd processes, grouped by the receiver."""

from .codec import Decoder, ProtocolError, encode
from .control import EngineUnresponsive, ModelControl, ModelLoadFailed, Ready
from .sampling import PARAMS, REPETITION_CONTEXT, Param, SamplingParams
from .to_client import ErrorReply, StatsReply, StreamChunk
from .to_scheduler import (
    MAX_PINS, Abort, GetStats, Pin, StepResult, StepTiming, TokenizedRequest, WorkerError,
    WorkerLimits, WorkerReady,
)
from .to_tokenizer import (
    AbortRequest, GenerateRequest, SchedulerReady, Stats, StatsRequest, TokenBatch,
    TokenEntry, Usage,
)
from .to_worker import DecodeRow, DiskRun, PrefillInput, Spill, Step

__all__ = [
    "MAX_PINS", "PARAMS", "REPETITION_CONTEXT", "Abort", "AbortRequest", "DecodeRow", "Decoder",
    "DiskRun", "EngineUnresponsive", "ErrorReply", "GenerateRequest", "GetStats", "ModelControl",
    "ModelLoadFailed", "Param", "Pin", "PrefillInput", "ProtocolError", "Ready",
    "SamplingParams", "SchedulerReady", "Spill", "Stats", "StatsReply", "StatsRequest", "Step",
    "StepResult", "StepTiming", "StreamChunk", "TokenBatch", "TokenEntry", "TokenizedRequest",
    "Usage", "WorkerError", "WorkerLimits", "WorkerReady", "encode",
]
