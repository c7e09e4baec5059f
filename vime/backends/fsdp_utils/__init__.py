"""Torch-native training backend: Hugging Face models sharded with FSDP2, one code path for CPU (gloo) and GPU
(nccl). Entry point: ``vime.backends.fsdp_utils.trainer.FSDPTrainer``.

Modules: ``model`` (load + shard), ``log_probs`` (packed forward), ``loss`` (per-micro-batch losses),
``optimizer`` (optimizer + LR schedule), ``checkpoint`` (DCP checkpoints, HF export), ``weights`` (HF-named
weight buckets for weight sync), ``trainer`` (the loop over steps and micro-batches).
"""
