"""Studies: experiments built on fine-tuning and the benchmarks, never imported by them.

  books                 the book task: which author wrote a passage (embedded corpus)
  books_ood             the same task on authors pretraining never saw
  text_tasks            text tasks cut from any text (authorship, acceptability, coherence)
  bag_of_pieces         the bag-of-pieces logistic regression baseline
  text_task_experiment  the driver: pretrained against random against a bag of pieces
"""
