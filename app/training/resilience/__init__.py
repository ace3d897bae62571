"""What keeps a run safe: fault handling, apart from the checkpointer it asks
(app.training.checkpointing). `guard.RunGuard` is what the trainer holds: the non-finite
policy (nonfinite), loss-spike rollback (rollback), exit signals and the launcher watch
(signals), the peer watchdog (watchdog) and in-process restart (inprocess); save_dir is the
--save writer lock and checks."""
