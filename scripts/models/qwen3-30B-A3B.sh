# Qwen/Qwen3-30B-A3B (MoE: 128 experts, top-8, renormalised)
# Megatron flags for the HF config (checked against config.json at start: a mismatch names the field).
MODEL_ARGS=(
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --qk-layernorm
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --max-position-embeddings 40960
   --vocab-size 151936
   --untie-embeddings-and-output-weights
   --num-experts 128
   --moe-ffn-hidden-size 768
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-router-dtype fp32
   --moe-token-dispatcher-type alltoall
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --position-embedding-type rope
   --transformer-impl local
)
