"""SQuAD (Rajpurkar et al. 2016, 2018) from its official JSON or TFDS: span extraction
(BERT) or the answer generated as text (T5), scored by exact match and F1;
predictions.json is the official evaluation script's input.

  --config.benchmark.data_dir=squad       # squad/train-v1.1.json, dev-v1.1.json (v2.0 likewise)
  tfds build squad/v1.1 --data_dir ~/tensorflow_datasets --file_format array_record   # or this
  t5x-like finetune --config configs/squad.py:v1.1 --workdir workdir/squad \\
      --config.init.checkpoint=workdir/bert_base

Tasks: v1.1, v2.0 (no-answer questions: the [CLS] span for BERT, an empty answer for
T5); family=t5 for T5 (t5x_like/benchmarks/configs.py has the arguments).
"""

import os

from t5x_like.benchmarks.configs import benchmark_config


def get_config(arg: str = "v1.1"):
  return benchmark_config("squad", arg, os.path.dirname(os.path.abspath(__file__)))
