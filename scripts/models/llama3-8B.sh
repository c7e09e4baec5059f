# meta-llama/Meta-Llama-3-8B
# Megatron flags for the HF config (checked against config.json at start: a mismatch names the field).
MODEL_ARGS=(
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --norm-epsilon 1e-5
   --rotary-base 500000
   --max-position-embeddings 8192
   --vocab-size 128256
   --untie-embeddings-and-output-weights
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --position-embedding-type rope
   --transformer-impl local
)
