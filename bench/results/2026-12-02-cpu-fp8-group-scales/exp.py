"""Variant sweep for fp8 accuracy: python .ab/exp.py VARIANT [VARIANT...]"""
import json, os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from bench.quant_accuracy import PROMPTS, TEXT, perplexity, agreement
import minivllm.model.quantization as Q
import variants as V

REF = Path(__file__).parent / "ref.json"

def run(name):
    from minivllm import LLM, SamplingParams
    from minivllm.default_model import ensure_default_model
    import minivllm.model.loader as LD
    orig = (Q.quantize_fp8, Q.quantize_activations_fp8, Q.quantizes_activations)
    oqm = LD.quantize_model
    method = V.apply(name, Q)
    t = time.perf_counter()
    llm = LLM(str(ensure_default_model()), quantization=method, device="cpu", dtype="auto",
              max_model_len=1024, max_num_seqs=len(PROMPTS), gpu_memory_utilization=0.3)
    tload = time.perf_counter() - t
    tf = os.environ.get("TEXTFILE")
    ids = llm.engine.tokenize(Path(tf).read_text() if tf else TEXT.read_text())
    if tf: ids = ids[:int(os.environ.get("TEXTTOK", 3072))]
    ppl, _ = perplexity(llm, ids, 512)
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = [o.outputs[0].token_ids for o in llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)]
    if name == "none" and not tf:
        REF.write_text(json.dumps(outs))
    ref = json.loads(REF.read_text())
    share, same = agreement(outs, ref)
    Q.quantize_fp8, Q.quantize_activations_fp8, Q.quantizes_activations = orig
    LD.quantize_model = oqm
    row = dict(text=os.environ.get("TEXTFILE", "eval"), variant=name, ppl=round(ppl, 3), vs_none=round(ppl / 23.636, 4), agree=round(share, 3),
               identical=f"{same}/{len(outs)}", load_s=round(tload, 1), s=round(time.perf_counter() - t, 1))
    print(json.dumps(row), flush=True)
    with open(Path(__file__).parent / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    del llm

for n in sys.argv[1:]:
    run(n)
