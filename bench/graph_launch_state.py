"""Does a CUDA graph of small kernels replay slower after regular kernel launches, without
minivllm (GPU only)? A standalone probe of what bench/replay_state.py found in the decode
graph: ~0.35 us more between every two kernels of a replay once two kernels have been
launched outside the graph, until the step's kernels are launched eagerly again.

The graph is 200 kernels on one small tensor, alternating two elementwise functions
(add, mul). After each action the replay is timed (CUDA events, back to back).

    python -m bench.graph_launch_state [--out FILE]
"""

from __future__ import annotations

import torch

from bench.common import gpu_probe_parser, has_cuda, replays_us, write_result

KERNELS = 200


def main(argv=None) -> int:
    ap = gpu_probe_parser(__doc__)
    args = ap.parse_args(argv)
    if not has_cuda("graph_launch_state"):
        return 1
    x = torch.zeros(4096, device="cuda")
    other = torch.zeros(4096, device="cuda")

    def ops(n: int = KERNELS) -> None:
        for i in range(n):
            if i % 2:
                x.mul_(1.0)
            else:
                x.add_(0.0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops()
    actions = {
        "base": lambda: None,
        "foreign": lambda: other.sub_(0.0),        # a function the graph does not have
        "graph_fn": lambda: other.add_(0.0),       # the graph's first function
        "eager_all": ops,                          # the graph's kernels, launched eagerly
        "eager_last2": lambda: ops(2),
        "eager_8": lambda: ops(8),
    }
    sequence = ["base", "foreign", "foreign", "eager_all", "foreign", "foreign", "eager_last2", "eager_8", "foreign", "foreign", "graph_fn", "graph_fn", "foreign", "foreign", "eager_all"]
    rows = []
    for name in sequence:
        actions[name]()
        torch.cuda.synchronize()
        for _ in range(10):
            graph.replay()
        us = replays_us(graph, 200)
        rows.append({"action": name, "replay_us": round(us, 1),
                     "us_per_kernel": round(us / KERNELS, 3)})
        print(f"after {name:12s}: replay {us:7.1f} us ({us / KERNELS:.3f} us per kernel)",
              flush=True)
    write_result("graph_launch_state", {"kernels": KERNELS, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
