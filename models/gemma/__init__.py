"""Gemma 1/2/3 text models: config, Flax model, LoRA, KV-cache sampling."""

from models.gemma.config import GemmaConfig
from models.gemma.lora import is_lora_path, merge_lora
from models.gemma.model import Gemma, init_params, logits_from_hidden
from models.gemma.sampling import generate, generate_without_cache

__all__ = ["Gemma", "GemmaConfig", "generate", "generate_without_cache", "init_params", "is_lora_path",
           "logits_from_hidden", "merge_lora"]
