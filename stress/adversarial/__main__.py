"""``python -m stress.adversarial``: the campaign's runner (``campaign.main``)."""

from stress.adversarial.campaign import main

raise SystemExit(main())
