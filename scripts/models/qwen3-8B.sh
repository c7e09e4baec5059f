# Qwen/Qwen3-8B
# Megatron flags for the HF config (checked against config.json at start: a mismatch names the field).
MODEL_ARGS=(
   --num-layers 36
   --hidden-size 4096
   --ffn-hidden-size 12288
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --max-position-embeddings 40960
   --vocab-size 151936
   --untie-embeddings-and-output-weights
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --position-embedding-type rope
   --transformer-impl local
)
