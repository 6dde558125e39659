"""Model architectures (HF parameter names, so checkpoints load by name) and their registry,
keyed by config.json's `architectures[0]`. Every model exposes `forward(batch) -> hidden
[num_tokens, hidden_size]` (after the final norm) and `compute_logits(hidden) -> [n, vocab]`
float32."""

from gpu_worker.models.config import ArchConfig, read_arch_config
from gpu_worker.models.registry import MODEL_REGISTRY, build_model, get_model_class

__all__ = ["MODEL_REGISTRY", "ArchConfig", "build_model", "get_model_class", "read_arch_config"]
