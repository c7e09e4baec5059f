# zai-org/GLM-4.5-Air (MoE: 128 routed + 1 shared expert, sigmoid router with expert bias; first layer dense; MTP layer not loaded)
# Megatron flags for the HF config (checked against config.json at start: a mismatch names the field).
MODEL_ARGS=(
   --num-layers 46
   --hidden-size 4096
   --ffn-hidden-size 10944
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --add-qkv-bias
   --rotary-percent 0.5
   --norm-epsilon 1e-5
   --rotary-base 1000000
   --max-position-embeddings 131072
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   --num-experts 128
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 1408
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 1.0
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --moe-router-dtype fp32
   --moe-layer-freq '([0]*1+[1]*45)'
   --moe-token-dispatcher-type alltoall
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --position-embedding-type rope
   --transformer-impl local
)
