"""SuperGLUE (Wang et al. 2019) from its own JSONL files or TFDS: the tasks the
fine-tuning task types cover.

  --config.benchmark.data_dir=superglue   # its unpacked zips: superglue/BoolQ/train.jsonl,
                                          # val.jsonl, test.jsonl; CB COPA RTE WiC likewise
  tfds build super_glue/boolq --data_dir ~/tensorflow_datasets --file_format array_record   # or
  t5x-like finetune --config configs/superglue.py:boolq --workdir workdir/sg_boolq \\
      --config.init.checkpoint=workdir/bert_base

Tasks: boolq cb copa rte wic (COPA as a pair classification: which choice is the
premise's cause or effect); family=t5 for T5 text to text. MultiRC, ReCoRD and WSC need
task types not written yet (t5x_like/benchmarks/configs.py has the arguments).
"""

import os

from t5x_like.benchmarks.configs import benchmark_config


def get_config(arg: str = "boolq"):
  return benchmark_config("super_glue", arg, os.path.dirname(os.path.abspath(__file__)))
