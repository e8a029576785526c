"""The fine-tuning tasks `t5x-like task` builds: train/dev/test files cut from text.

  text_tasks  authorship, acceptability, coherence from any text source
  books       which embedded book a passage is from, and the pretraining text without it
  books_ood   the same on authors pretraining never saw (books-unseen, books-within)

Built from data/ (sources, sentences) and corpus/ only; fine-tuning reads what they
write (configs/finetune_books.py, configs/text_tasks.py).
"""
