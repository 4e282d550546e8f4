"""``python -m stress.faults``: the campaign's runner (``campaign.main``)."""

from stress.faults.campaign import main

raise SystemExit(main())
