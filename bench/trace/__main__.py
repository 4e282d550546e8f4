"""``python -m bench.trace``: the trace benchmark's runner (``run.main``)."""

from bench.trace.run import main

raise SystemExit(main())
