"""W4 (CPU): SmolLM2-135M fp32, 8 requests x 64 output tokens.

minivllm with all 8 requests in one continuous batch, and one at a time, against Hugging
Face generate one at a time and batched (left padding). Output tokens/s of each, in one run.
Usage: OMP_NUM_THREADS=1 python -m bench.w4_cpu [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from bench.common import print_table, write_result

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about GPUs.", "What is 2+2?",
    "Name three colors.", "Explain what a KV cache is.", "Translate 'good morning' to Spanish.",
    "Give me a fun fact about octopuses.", "Write a Python function that adds two numbers.",
]
NEW_TOKENS = 64


def run_minivllm(model_dir, prompts, one_at_a_time: bool) -> float:
    from minivllm import LLM, SamplingParams

    llm = LLM(str(model_dir), max_model_len=1024, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    return elapsed


def run_hf(model_dir, prompts, batched: bool) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=tok.pad_token_id or tok.eos_token_id)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        if batched:
            enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
            out = model.generate(**enc, **kw)
            assert out.shape[1] - enc["input_ids"].shape[1] == NEW_TOKENS
        else:
            for p in prompts:
                model.generate(torch.tensor([p]), **kw)
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from minivllm.default_model import ensure_default_model
    from minivllm.tokenizer import load_tokenizer, render_chat

    model_dir = ensure_default_model()
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode(render_chat(tok, [{"role": "user", "content": q}]),
                          add_special_tokens=False) for q in QUESTIONS]
    total = NEW_TOKENS * len(prompts)
    runs = [
        ("minivllm batched (8 concurrent)", lambda: run_minivllm(model_dir, prompts, False)),
        ("minivllm one at a time", lambda: run_minivllm(model_dir, prompts, True)),
        ("HF generate one at a time", lambda: run_hf(model_dir, prompts, False)),
        ("HF generate batched (padded)", lambda: run_hf(model_dir, prompts, True)),
    ]
    rows = []
    for name, fn in runs:
        secs = fn()
        rows.append({"engine": name, "seconds": secs, "output_tok_per_s": total / secs})
        print(f"{name}: {secs:.2f} s", flush=True)
    base = next(r for r in rows if r["engine"] == "HF generate one at a time")
    for r in rows:
        r["speedup_vs_hf_one_at_a_time"] = r["output_tok_per_s"] / base["output_tok_per_s"]
    print_table(rows, ["engine", "seconds", "output_tok_per_s", "speedup_vs_hf_one_at_a_time"])
    path = write_result("w4_cpu", {
        "workload": {"model": "SmolLM2-135M-Instruct", "dtype": "float32",
                     "requests": len(prompts), "output_tokens": NEW_TOKENS,
                     "prompt_tokens": [len(p) for p in prompts], "greedy": True},
        "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
