"""GPT-2 124M / 355M causal LM pretraining (Radford et al. 2019).

  t5x-like train --config configs/gpt2_pretrain.py:124m --workdir gs://BUCKET/gpt2
  t5x-like train --config configs/gpt2_pretrain.py:124m,local --workdir /tmp/g  (CPU)

GPT-2's WebText is not public; the default source is TFDS c4/en (override
data.source, e.g. with jsonl:GLOB for OpenWebText shards). Length 1024, batch 512
(about 0.5M tokens per step), 600k steps, AdamW (b2 0.95, weight decay 0.1 off norms
and biases) with 2k warmup steps and cosine decay to 10% of the peak (6e-4 for 124M,
3e-4 for 355M), clipping at 1.0, dropout 0.0 (as in nanoGPT-style reproductions).
Made for a v4-64 (32 devices, data parallel). Vocabulary: GPT-2's 50,257 rows (set data.vocab to a 'gpt' family sentencepiece
model; `<|endoftext|>` ends every document).
"""

from t5x_like.train.defaults import default_config, parse_arg, smoke_schedule

_SIZES = {"124m": ("gpt2-124m", 6e-4), "355m": ("gpt2-355m", 3e-4)}


def get_config(arg: str = "124m"):
  a = parse_arg(arg, size="124m", local=False)
  if a.size not in _SIZES:
    raise ValueError(f"configs/gpt2_pretrain.py: size {a.size!r}; known: {sorted(_SIZES)}")
  name, lr = _SIZES[a.size]
  c = default_config()
  c.model.preset = name
  c.model.overrides = dict(vocab_size=50257, dropout_rate=0.0, attention_dropout_rate=0.0)
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True
  # `t5x-like plan --topology v4-64` (16 rows of 1024 per device): 124M needs remat to fit
  # 32 GiB (none: 39 GiB; dots_no_batch: 20 GiB), 355M full remat (dots_no_batch: 32.4).
  c.model.remat_policy = "full" if a.size == "355m" else "dots_no_batch"

  c.data.source = "tfds:c4/en:train#text"
  c.data.objective = "causal_lm"
  c.data.length = 1024
  c.data.eval_fraction = 0.001

  c.train.batch_size = 512
  c.train.num_steps = 600_000
  c.train.log_every = 100
  c.train.eval_every = 5_000
  c.train.eval_batches = 20
  c.train.checkpoint_every = 5_000

  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = lr
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 2_000
  c.optimizer.end_learning_rate_fraction = 0.1
  c.optimizer.weight_decay = 0.1
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.95, 1e-8
  c.optimizer.clip_norm = 1.0

  c.mesh.data = -1
  c.mesh.fsdp = 1
  if a.local:
    c.model.overrides = dict(d_model=64, num_heads=2, d_ff=128, num_layers=1,
                             max_position_embeddings=64, dropout_rate=0.0,
                             attention_dropout_rate=0.0)
    c.model.dtype = "float32"
    c.model.remat_policy = "none"
    c.data.source = "embedded"
    c.data.eval_fraction = 0.02
    smoke_schedule(c)
  return c
