"""t5x_like: pretraining and fine-tuning of BERT, GPT-2 and T5 families in JAX/Flax."""

__version__ = "0.1.0"
