"""Run one job at a time on a helper thread: how the worker computes a chained
decode step while its main thread sends results and waits for the next Step.

`mx.eval` and `mx.async_eval` release the GIL, so the main thread's socket work runs
alongside. The runner's job is an `mx.async_eval`, which on the CPU backend returns
only when at most a handful of the graph's tasks are still queued, i.e. near the end:
the job ends then, and `finished_at` is that moment, not the end of the compute.
The owner must not touch MLX state the job uses until `wait()` returns.
"""

import queue
import threading
import time
from typing import Callable


class BackgroundJob:
    def __init__(self, name: str = "mlxd-chained"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._running = False
        self.finished_at = 0.0   # perf_counter() when the last job ended
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    @property
    def running(self) -> bool:
        return self._running

    def start(self, job: Callable[[], None]) -> None:
        if self._running:
            raise RuntimeError("a background job is already running")
        self._running = True
        self._done.clear()
        self._jobs.put(job)

    def wait(self, timeout: float | None = None) -> float:
        """Block until the job ends (at most `timeout` s); its end time. Re-raises
        the job's exception."""
        if not self._running:
            return self.finished_at
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background job did not end within {timeout} s")
        self._running = False
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self.finished_at

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException as exc:   # handed to the owner by wait()
                self._error = exc
            del job   # hold nothing of the owner's between jobs
            self.finished_at = time.perf_counter()
            self._done.set()
