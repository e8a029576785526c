"""Benchmarks: the suites people report (GLUE, SuperGLUE, SQuAD), where their examples
come from, their official metrics and their submission files. Fine-tuning itself (the
runner, heads, task types) is t5x_like/finetune/; this package says *what* is fine-tuned
and how it is scored.

  registry     one Benchmark per task: input templates (BERT pairs, T5 text to text),
               official metrics, dev and test splits, submission format; SUITES
  configs      the fine-tuning configs of configs/glue.py, superglue.py, squad.py
  sources      a benchmark's splits: from files_source where data_dir holds the task's
               own files (GLUE TSV, SuperGLUE JSONL, SQuAD JSON), else tfds_source (a
               TFDS array_record build); the same examples either way
  task_data    a benchmark as fine-tuning's data source (finetune/task_data.TaskData):
               task, splits and hold-out, checks, outputs; task_data(config) picks the
               source of a config
  outputs      a run's official metrics and submission files
  metrics      the GLUE score
  suite        the finetune-suite runner (every task, the learning-rate grid);
               suite_table its table and suite.json
"""
