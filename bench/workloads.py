"""The offline workloads of the head-to-head with vLLM (W1, W2, W5, W6, and the decode
sweep): each request's prompt ids and output length, drawn the same way for every engine.
No torch here, so bench/roofline.py (and the report through it) can read the same requests.
"""

from __future__ import annotations

import random

# Prompt ids are drawn in [10, VOCAB_LIMIT): ids every model's vocabulary has.
VOCAB_LIMIT = 10000


class Workload:
    """`requests(rep)`: [(prompt ids, output tokens)], fresh for each repetition."""

    def __init__(self, name: str, metric: str, n: int, prompt: tuple[int, int],
                 output: tuple[int, int], reps: int, vocab: int) -> None:
        self.name, self.metric, self.n, self.reps = name, metric, n, reps
        self.prompt, self.output, self.vocab = prompt, output, min(vocab, VOCAB_LIMIT)

    def requests(self, rep: int, n: int | None = None) -> list[tuple[list[int], int]]:
        rng = random.Random(f"{self.name}-{rep}")
        out = []
        for _ in range(self.n if n is None else n):
            lo, hi = self.prompt
            ids = [rng.randrange(10, self.vocab) for _ in range(rng.randint(lo, hi))]
            out.append((ids, rng.randint(*self.output)))
        return out

    def warm_up(self) -> list[tuple[list[int], int]]:
        """A small run of the same shapes: a few requests, a few output tokens."""
        return [(p, min(o, 8)) for p, o in self.requests(-1, min(self.n, 4))]


def workloads(smoke: bool, vocab: int) -> dict[str, Workload]:
    if smoke:
        return {"W1": Workload("W1", "output_tok_per_s", 6, (8, 32), (4, 16), 2, vocab),
                "W2": Workload("W2", "output_tok_per_s", 1, (16, 16), (8, 8), 2, vocab),
                "W5": Workload("W5", "prompt_tok_per_s", 2, (128, 128), (1, 1), 2, vocab),
                "W6": Workload("W6", "output_tok_per_s", 2, (256, 256), (4, 4), 1, vocab)}
    return {"W1": Workload("W1", "output_tok_per_s", 256, (100, 1024), (100, 1024), 2, vocab),
            "W2": Workload("W2", "output_tok_per_s", 1, (128, 128), (256, 256), 3, vocab),
            "W5": Workload("W5", "prompt_tok_per_s", 32, (4096, 4096), (1, 1), 5, vocab),
            "W6": Workload("W6", "output_tok_per_s", 64, (8192, 8192), (256, 256), 1, vocab)}


class DecodeSweep:
    """The decode sweep: for each batch size B, B requests of `prompt` tokens run for one
    output token and, with fresh prompts, for 1 + `steps`; the difference over `steps` is
    one decode step's time at batch B and that context (the prefill cancels out, and fresh
    prompts keep the prefix cache out of it; an engine that decodes some sequences while
    prefilling others counts what those steps cost extra). Best of `reps`."""

    def __init__(self, batches: list[int], prompt: int, steps: int, reps: int,
                 vocab: int) -> None:
        self.batches, self.prompt, self.steps, self.reps = batches, prompt, steps, reps
        self.vocab = vocab

    def runs(self, batch: int, rep: int) -> tuple[Workload, Workload]:
        """(the one-token run, the 1 + steps run) of one repetition at `batch`."""
        p = (self.prompt, self.prompt)
        return (Workload(f"D{batch}-short-{rep}", "", batch, p, (1, 1), 1, self.vocab),
                Workload(f"D{batch}-long-{rep}", "", batch, p,
                         (1 + self.steps, 1 + self.steps), 1, self.vocab))


def decode_sweep(smoke: bool, vocab: int) -> DecodeSweep:
    if smoke:
        return DecodeSweep([1, 2], 16, 4, 1, vocab)
    return DecodeSweep([1, 8, 16, 32, 64, 128], 1024, 256, 2, vocab)
