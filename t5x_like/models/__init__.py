"""Pure Flax (linen) models of the three families and their shared building blocks."""

from t5x_like.models.config import PRESETS, ModelConfig, bert, gpt2, preset, t5
from t5x_like.models.model import (DecoderModel, EncoderDecoderModel, EncoderModel, Model,
                                   build_model, model_class)

__all__ = [
    "PRESETS", "ModelConfig", "bert", "gpt2", "preset", "t5", "DecoderModel",
    "EncoderDecoderModel", "EncoderModel", "Model", "build_model", "model_class",
]
