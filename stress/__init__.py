"""Robustness campaigns against the real service: fuzz (``stress.fuzz``), attacks from
outside (``stress.adversarial``) and disk faults (``stress.faults``). Each has a
``python -m stress.<campaign> --json`` runner, its REPORT.md section (``report``) and its
pytest assertions (``test_*.py``, in ``make test``). Not shipped; imports nothing from
``bench``."""
