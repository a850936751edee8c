cp /tmp/vb/a0 /tmp/vb/a1 .vllm/ && source .vllm/install.sh || exit 1
export MINIVLLM_GIT_COMMIT=$(cat bench/.commit)
mkdir -p $OUT/t
PYTHONPATH=$PWD/src:$PWD timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py -k split_k_matmul_compiled > $OUT/t/gpu_tests.log 2>&1; tail -2 $OUT/t/gpu_tests.log
RES=/tmp/vsres OUT=$OUT TOTAL_S=420 VS_PARTS="mini-offline vllm-offline" VS_WORKLOADS=w2,sweep VS_QUANT=fp8 bash bench/run_vs_vllm.sh llama-3.1-8b
