"""bench.vs_vllm with the fp8 activations quantized by their own kernel again (the norms
and SiLU x up write 16 bits): the A/B of the fused quantization."""
import sys
from minivllm.model import layers, llama
for m in (layers, llama):
    m.fp8_activations_for = lambda *a: None
from bench.vs_vllm import main
sys.exit(main(sys.argv[1:]))
