"""The commands of `t5x-like` (t5x_like/cli.py dispatches to them), one module each,
named by the command: train, finetune, finetune_suite (finetune-suite), infer, plan, bench, vocab, models, task, prepare
(`data prepare`). Each parses absl flags through command_flags, reports user errors in
one line, and calls the library (train/, finetune/, infer/, plan/, speed/, data/) that
does the work."""
