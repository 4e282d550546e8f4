"""The fuzz campaign: hostile requests to every RPC of a live server and replay worker.

Modules: ``pool`` (honest sessions and their Spill messages), ``state`` (cases and what
they refer to), ``messages`` (random protobuf messages), ``layouts`` (RegisterLayout
bodies), ``cases`` (the generator), ``campaign`` (the run and its runner), ``report``
(its REPORT.md section)."""
