"""Surviving a lost host: what lets a multi-process run lose a process and carry on.

  distributed.py      start-up: jax.distributed behind a watchdog (exit 3) and the guard
  peer_guard.py       each process's parent: a lost peer is one line and exit 75
  peer_loss.py        recognising a lost peer in jax's text, the line survivors print
  restart_policy.py   which exit statuses restart the run, give up or finish
  supervisor.py       runs the N workers and restarts them all when one is lost

Imports nothing here: the supervisor runs on a laptop with the standard library only
(`python3 -m t5x_like.host_loss.supervisor`).
"""
