"""An optional trace of the engine process's loop, for finding where serving time goes.

With MINIVLLM_ENGINE_TRACE=PATH the engine process records, per loop iteration, when it
woke, how many commands it read, how long its step took and what the step was (the model
runner's path: decode_graph, decode_pipelined, mixed_graph, mixed_pipelined, long (a step
past the graphs, run eagerly), long_pipelined or eager; tokens; sequences),
and for every added request how long it took from the frontend's arrival stamp to the
engine reading it. The JSON is written to PATH when the engine process ends (data-parallel
engine K > 0 writes PATH's name with -dpK before its extension). Timestamps
are time.monotonic(), which is system-wide on Linux, so a benchmark can cut the trace
into its own levels (bench/engine_trace.py). Off by default: a tuple append per
iteration when on.
"""

from __future__ import annotations

import json
import os
import time

ENV = "MINIVLLM_ENGINE_TRACE"
MAX_RECORDS = 2_000_000  # ~1 hour at 500 steps/s; later iterations are not recorded

STEP_FIELDS = ("woke", "commands_read", "step_end", "commands", "path", "tokens", "seqs")
ADD_FIELDS = ("received", "since_arrival")


class StepTrace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[tuple] = []
        self.adds: list[tuple] = []

    @classmethod
    def from_env(cls, data_parallel_rank: int = 0) -> "StepTrace | None":
        path = os.environ.get(ENV)
        if path and data_parallel_rank:
            stem, ext = os.path.splitext(path)
            path = f"{stem}-dp{data_parallel_rank}{ext}"
        return cls(path) if path else None

    def add_received(self, arrival_time: float | None) -> None:
        if arrival_time is not None and len(self.adds) < MAX_RECORDS:
            now = time.monotonic()
            self.adds.append((now, now - arrival_time))

    def step(self, woke: float, commands_read: float, step_end: float, commands: int,
             last_step: tuple | None) -> None:
        if len(self.steps) < MAX_RECORDS:
            path, tokens, seqs = last_step or (None, 0, 0)
            self.steps.append((woke, commands_read, step_end, commands, path, tokens, seqs))

    def dump(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step_fields": STEP_FIELDS, "steps": self.steps,
                       "add_fields": ADD_FIELDS, "adds": self.adds}, f)
        os.replace(tmp, self.path)
