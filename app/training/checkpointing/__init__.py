"""Every checkpoint of a training run, saved and loaded, behind one object: the run's
`checkpointer.Checkpointer` (when to save what where, the failed-save policy, what a resume or
a rollback loads), on these parts:

    checkpointer.py  the Checkpointer the trainer holds: maybe_save, save_final, load_latest,
                     rollback_target, load
    saver.py         one kind of save (persistent, global or local) and the failed-save policy
                     (--max-failed-saves, SaveFailed)
    local.py         local non-persistent checkpoints with replicas (files, groups, scan, load)
    latest.py        the one choice of what a resume or a rollback loads
    resume.py        the resume policy both engines share (--finetune, --no-load-*, the start
                     decision, the ranks' agreement on what they loaded)
    data_order.py    no silent change of data order on resume

The formats themselves (file names, readers, writers, the crash-safe commit) are
app.checkpoint's; fault handling (app.training.resilience) asks the checkpointer, never the
reverse."""
