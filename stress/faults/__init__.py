"""The fault campaign against the disk tier: power loss, ENOSPC and EIO, index repair.

Modules: ``cases`` (ENOSPC and EIO per call site), ``repair_trials`` (a lost or damaged
index rebuilt), ``campaign`` (the run, with ``testing.power_loss``, and its runner),
``report`` (its REPORT.md section)."""
