"""Where a batch-1 decode step's wall time goes beyond its kernels (GPU only).

The engine's W2 step takes ~1.07 ms on the H200 while one graph replay alone takes ~0.96
ms at the same context (session 5); the ~0.1 ms between them is the 7% W2 misses its
target by. This splits one step of the graph runner, per context, into:
  - replay_us: graph replays back to back, inputs staged once (device time, CUDA events):
    the kernels plus the gaps inside and between graphs;
  - run_us: the graph runner's run() back to back (staging + copies + replay), wall time
    per step with the host free to run ahead (what the sweep measures);
  - host_run_us: the host's own time per run() (measured before the final synchronize;
    if it is near run_us the host is the limit);
  - fill_us: the host's staging alone (DecodeInputs.fill, copies queued);
then W2's pattern (context 128 -> 384) without and with the engine's pipelining and each
of its parts, and the engine's W2 itself, per step, each with the GPU's SM clock meanwhile
(NVML); last, the device time of each batch-1 replay inside the engine's own W2 loop.

    python -m bench.w2_gap [--out FILE]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from bench.common import gpu_probe_parser, has_cuda, probe_llm, replays_us, write_result

CONTEXTS = [128, 256, 384, 512, 768, 1024, 1536]
ITERS = 200


def per_step_us(fn, iters: int) -> tuple[float, float]:
    """(host us per call before synchronizing, wall us per call after it)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return 1e6 * host / iters, 1e6 * wall / iters


class ClockSampler:
    """The GPU's SM clock (MHz, NVML) sampled every few ms while a loop runs: a step that
    takes 10% longer in one loop than in another may simply run at a lower clock."""

    def __init__(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no NVML: no clocks, the timings still count
            self._nvml = None
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        self._samples, self._stop = [], threading.Event()
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._samples.append(self._nvml.nvmlDeviceGetClockInfo(
                self._handle, self._nvml.NVML_CLOCK_SM))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict | None:
        if not self._samples:
            return None
        return {"sm_mhz_mean": round(sum(self._samples) / len(self._samples)),
                "sm_mhz_min": min(self._samples), "sm_mhz_max": max(self._samples)}


def timed_replays(graph: torch.cuda.CUDAGraph) -> list:
    """Wrap graph.replay so each replay records CUDA events around itself; returns the list
    the (start, end) pairs go to (device time of each replay inside someone else's loop)."""
    pairs: list = []
    replay = graph.replay

    def timed() -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        pairs.append((start, end))

    graph.replay = timed
    return pairs


def main(argv=None) -> int:
    ap = gpu_probe_parser(__doc__, model_config=True)
    args = ap.parse_args(argv)
    if not has_cuda("w2_gap"):
        return 1
    llm, gr, bs = probe_llm(args.model_config)
    graph = gr.graphs[1]
    rows = []
    for ctx in CONTEXTS:
        table = [list(range(-(-ctx // bs)))]
        call = (lambda ctx=ctx, table=table: gr.run([7], [ctx], table))
        for _ in range(20):
            call()
        host_run, run = per_step_us(call, ITERS)
        fill_host, _ = per_step_us(
            lambda ctx=ctx, table=table: gr.inputs.fill([7], [ctx], table, 1), ITERS)
        gr.inputs.fill([7], [ctx], table, 1)
        replay = replays_us(graph, ITERS)
        rows.append({"context": ctx, "replay_us": round(replay, 1), "run_us": round(run, 1),
                     "host_run_us": round(host_run, 1), "fill_us": round(fill_host, 1)})
        print(f"context {ctx:5d}: replay {replay:7.1f} us  run {run:7.1f} us  host per run "
              f"{host_run:6.1f} us  fill {fill_host:5.1f} us", flush=True)
    # W2's own pattern: context growing 128 -> 384 (a new slot each step), then the same
    # with the engine's pipelining (input token from the previous step on the device, the
    # sampled token copied to pinned memory behind an event, the host waiting one step
    # behind), then the engine's W2 itself.
    steps = 256
    tables = [list(range(-(-(128 + steps) // bs)))]

    def advancing() -> None:
        for i in range(steps):
            gr.run([7], [128 + i], tables)

    def pipelined(device_ids: bool = True, readback: bool = True, behind: int = 1,
                  spin: bool = False) -> None:
        """The engine's loop: step i's input token read on the device from step i-1's
        output (device_ids), its token copied to pinned memory behind an event
        (readback), the host waiting for the step `behind` steps back before going on
        (spin: polling its event instead of synchronizing on it)."""
        host = [torch.empty(1, dtype=torch.long, pin_memory=True) for _ in range(behind + 1)]
        events = []
        _, greedy = gr.run([7], [128], tables)
        for i in range(1, steps):
            if device_ids:
                _, greedy = gr.run(None, [128 + i], tables, (greedy, [0]))
            else:
                _, greedy = gr.run([7], [128 + i], tables)
            if not readback:
                continue
            h = host[i % (behind + 1)]
            h.copy_(greedy, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            events.append((ev, h))
            if len(events) > behind:
                old, oh = events.pop(0)
                if spin:
                    while not old.query():
                        pass
                else:
                    old.synchronize()
                oh.tolist()
        torch.cuda.synchronize()

    # Allocated after the first loops (see `allocate`): in s5 runF, with them allocated
    # first, even the plain loop ran ~90 us/step slower than in runs D and E.
    scratch: list[torch.Tensor] = []

    def allocate() -> None:
        scratch.append(torch.zeros(1, dtype=torch.long, device="cuda"))
        scratch.append(torch.zeros(1, dtype=torch.long, pin_memory=True))

    def advancing_with(extra) -> Callable[[], None]:
        """advancing, plus one small operation queued after each replay."""
        def loop() -> None:
            for i in range(steps):
                gr.run([7], [128 + i], tables)
                extra()
        return loop

    loops, loop_clocks = {}, {}
    clocks = ClockSampler()
    for name, fn in (("advancing", advancing),
                     ("advancing_again", advancing),
                     ("advancing_after_allocating", lambda: (allocate(), advancing())),
                     ("advancing_plus_kernel", advancing_with(lambda: scratch[0].add_(1))),
                     ("advancing_plus_d2h", advancing_with(
                         lambda: scratch[1].copy_(scratch[0], non_blocking=True))),
                     ("advancing_plus_event", advancing_with(
                         lambda: torch.cuda.Event().record())),
                     ("pipelined", pipelined),
                     ("pipelined_host_ids", lambda: pipelined(device_ids=False)),
                     ("device_ids_no_readback", lambda: pipelined(readback=False)),
                     ("pipelined_two_behind", lambda: pipelined(behind=2)),
                     ("pipelined_spin", lambda: pipelined(spin=True))):
        fn()
        torch.cuda.synchronize()
        with clocks:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
        loops[name] = round(1e6 * (time.perf_counter() - t0) / steps, 1)
        loop_clocks[name] = clocks.summary()
        print(f"{name}: {loops[name]} us/step over contexts 128-{128 + steps}; clock "
              f"{loop_clocks[name]}", flush=True)
    from minivllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    prompt = list(range(100, 228))
    llm.generate([prompt], params, use_tqdm=False)
    with clocks:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        total = time.perf_counter() - t0
    m = out.metrics
    loops["engine_w2"] = round(1e6 * (total - (m.first_token_time - m.arrival_time))
                               / (steps - 1), 1)
    loop_clocks["engine_w2"] = clocks.summary()
    # The same again with each batch-1 replay timed on the device: the replay's own time
    # inside the engine's loop, against the wall time per token.
    pairs = timed_replays(graph)
    llm.generate([prompt], params, use_tqdm=False)
    torch.cuda.synchronize()
    del graph.replay  # the class's replay again
    times = sorted(1000 * a.elapsed_time(b) for a, b in pairs)
    loops["engine_w2_replay_median"] = round(times[len(times) // 2], 1) if times else None
    loops["engine_w2_replay_mean"] = round(sum(times) / len(times), 1) if times else None
    print(f"engine W2: {loops['engine_w2']} us/token (clock {loop_clocks['engine_w2']}); "
          f"its replays {loops['engine_w2_replay_median']} us (median of {len(times)}, "
          f"mean {loops['engine_w2_replay_mean']})", flush=True)
    # The lone replay once more, after everything: has the GPU's state changed?
    gr.inputs.fill([7], [256], [list(range(-(-256 // bs)))], 1)
    with clocks:
        loops["replay_256_at_end"] = round(replays_us(graph, ITERS), 1)
    loop_clocks["replay_256_at_end"] = clocks.summary()
    print(f"replay at context 256, at the end: {loops['replay_256_at_end']} us "
          f"(clock {loop_clocks['replay_256_at_end']})", flush=True)
    write_result("w2_gap", {"model_config": args.model_config, "dtype": "bfloat16",
                            "batch": 1, "rows": rows, "loops": loops,
                            "loop_sm_clocks": loop_clocks},
                 args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
