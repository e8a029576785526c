"""GPT-2 causal LM on the embedded corpus, small enough for a laptop CPU.

  t5x-like train --config configs/gpt_cpu.py --workdir /tmp/gpt
  t5x-like train --config configs/gpt_cpu.py:smoke --workdir /tmp/gpts   (tests)
"""

from t5x_like.train.defaults import default_config, smoke_schedule


def get_config(arg: str = ""):
  c = default_config()
  c.model.preset = "gpt2-124m"
  c.model.overrides = dict(d_model=128, num_heads=2, d_ff=512, num_layers=2,
                           max_position_embeddings=128)
  c.data.objective = "causal_lm"
  c.data.length = 128
  c.train.batch_size = 32
  c.train.num_steps = 2000
  c.train.log_every = 50
  c.train.eval_every = 500
  c.train.checkpoint_every = 500
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1e-3
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 100
  c.optimizer.weight_decay = 0.1
  if arg == "smoke":
    c.model.overrides = dict(d_model=64, num_heads=2, d_ff=128, num_layers=1,
                             max_position_embeddings=64, dropout_rate=0.0,
                             attention_dropout_rate=0.0)
    smoke_schedule(c)
  elif arg:
    raise ValueError(f"configs/gpt_cpu.py: unknown variant {arg!r} (expected '' or 'smoke')")
  return c
