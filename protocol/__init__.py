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
from .to_worker import DiskRun, PrefillInput, Spill, Step

__all__ = [
    "MAX_PINS", "Abort", "AbortRequest", "Decoder", "ErrorReply", "GenerateRequest", "GetStats",
    "EngineUnresponsive", "ModelControl", "ModelLoadFailed", "PARAMS", "Param", "Pin", "DiskRun", "PrefillInput", "Spill", "ProtocolError", "REPETITION_CONTEXT", "Ready",
    "SamplingParams", "SchedulerReady", "Stats",
    "StatsReply", "StatsRequest", "Step", "StepResult", "StepTiming", "StreamChunk",
    "TokenBatch", "TokenEntry", "TokenizedRequest", "Usage", "WorkerError", "WorkerLimits",
    "WorkerReady", "encode",
]
