cp /tmp/vb/a0 /tmp/vb/a1 .vllm/ && source .vllm/install.sh || exit 1
export MINIVLLM_GIT_COMMIT=$(cat bench/.commit)
RES=/tmp/vsres OUT=$OUT TOTAL_S=500 VS_PARTS="mini-offline vllm-offline" VS_WORKLOADS=w2,sweep VS_QUANT=fp8 bash bench/run_vs_vllm.sh llama-3.1-8b
