"""``python -m stress.fuzz``: the campaign's runner (``campaign.main``)."""

from stress.fuzz.campaign import main

raise SystemExit(main())
