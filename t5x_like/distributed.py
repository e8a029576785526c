"""Moved to t5x_like/host_loss/distributed.py (issue 56 item 5). This alias stays only
until commands/finetune.py and commands/finetune_suite.py, reworked at the same time by
other hands, import from there; then it goes (tests/test_architecture.py names it)."""

from t5x_like.host_loss.distributed import (  # noqa: F401
    define_distributed_flags, initialize_distributed)
