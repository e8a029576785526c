"""GLUE (Wang et al. 2019) from its own TSV files or TFDS: fine-tune and predict one
task, or the suite.

  --config.benchmark.data_dir=glue_data   # GLUE's download: glue_data/CoLA/train.tsv, dev.tsv,
                                          # test.tsv ... (MNLI/dev_matched.tsv ...)
  tfds build glue/cola --data_dir ~/tensorflow_datasets --file_format array_record   # or this, once
  t5x-like finetune --config configs/glue.py:cola --workdir workdir/glue_cola \\
      --config.init.checkpoint=workdir/bert_base
  t5x-like finetune-suite --config configs/glue.py --workdir workdir/glue \\
      --init workdir/bert_base                    # every task in turn, then the GLUE score

Tasks: cola sst2 mrpc qqp stsb mnli qnli rte wnli; family=t5 for T5 text to text
(t5x_like/benchmarks/configs.py has the other arguments and the recipes).
"""

import os

from t5x_like.benchmarks.configs import benchmark_config


def get_config(arg: str = "cola"):
  return benchmark_config("glue", arg, os.path.dirname(os.path.abspath(__file__)))
