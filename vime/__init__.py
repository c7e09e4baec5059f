"""vime: RL post-training for LLMs with vLLM rollout (slime's design)."""

__version__ = "0.1.0"
