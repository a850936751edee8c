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


def workloads(smoke: bool, vocab: int, context: int | None = None) -> dict[str, Workload]:
    """The workloads; `context`: the model's max_model_len, where a workload's longest
    request would not fit in it (fit_context)."""
    if smoke:
        found = {"W1": Workload("W1", "output_tok_per_s", 6, (8, 32), (4, 16), 2, vocab),
                 "W2": Workload("W2", "output_tok_per_s", 1, (16, 16), (8, 8), 2, vocab),
                 "W5": Workload("W5", "prompt_tok_per_s", 2, (128, 128), (1, 1), 2, vocab),
                 "W6": Workload("W6", "output_tok_per_s", 2, (256, 256), (4, 4), 1, vocab)}
    else:
        found = {
            "W1": Workload("W1", "output_tok_per_s", 256, (100, 1024), (100, 1024), 2, vocab),
            "W2": Workload("W2", "output_tok_per_s", 1, (128, 128), (256, 256), 3, vocab),
            "W5": Workload("W5", "prompt_tok_per_s", 32, (4096, 4096), (1, 1), 5, vocab),
            "W6": Workload("W6", "output_tok_per_s", 64, (8192, 8192), (256, 256), 1, vocab)}
    for w in found.values():
        fit_context(w, context)
    return found


def fit_context(w: Workload, context: int | None) -> None:
    """Shorten a workload whose longest prompt + output passes `context` (Gemma 2's 8,192
    positions against W6's 8,448 tokens, GPT-2's 1,024 against W1's 2,048): the output
    lengths keep their range where they can (W6 still decodes 256 tokens, now past a
    shorter prompt), else both ranges scale down together. Every engine gets the same
    shortened requests; the JSON records the shapes that ran (`shapes`)."""
    if context is None or w.prompt[1] + w.output[1] <= context:
        return
    if w.output[1] < context // 2:  # the prompt gives way
        w.prompt = (min(w.prompt[0], context - w.output[1]), context - w.output[1])
        return
    scale = context / (w.prompt[1] + w.output[1])
    w.prompt = tuple(max(1, int(n * scale)) for n in w.prompt)
    w.output = tuple(max(1, int(n * scale)) for n in w.output)


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
