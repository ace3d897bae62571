"""What keeps a run safe: the start/resume/overwrite policy, the --save writer lock, exit signals
and the launcher watch, the peer watchdog, loss-spike rollback and the non-finite policy."""
