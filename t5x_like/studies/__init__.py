"""Studies: experiments built on fine-tuning and the benchmarks, never imported by them.

  text_task_experiment  the text-task driver: pretrained against random against a bag
                        of pieces, on `t5x-like task` tasks (task_builders/)
  glue_experiment       the GLUE driver: the same three arms on GLUE's dev sets
  glue_tables           the GLUE study's tables (official metrics, published rows)
  bag_of_pieces         the bag-of-pieces logistic regression baseline
  child_runs            what the drivers share: `t5x-like` children, logs, --configs,
                        exit statuses

The tasks the studies fine-tune on are built by the product (t5x_like/task_builders/).
"""
