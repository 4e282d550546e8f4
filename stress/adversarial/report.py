"""The REPORT.md section of ``stress.adversarial`` (``bench.report`` calls ``section``):
every case, whether it held and what it measured."""

from __future__ import annotations

import json

from stress.markdown import table


def section(stage: dict) -> list[str]:
    def measured(case: dict) -> str:
        shown = {k: v for k, v in case.items()
                 if k not in ("held", "seconds", "server_alive", "details", "spill_details")}
        return json.dumps(shown, separators=(", ", ": "))[1:-1].replace("|", "/")

    out = ["## Adversarial (`python -m stress.adversarial`)", "",
           "Attacks on the store, on layouts at run time and on prefix reuse, "
           "each against a live server and replay worker; "
           f"all held: **{'yes' if stage['all_held'] else 'no'}**.", ""]
    out += table(["case", "held", "measured"],
                 [[name, "yes" if case["held"] else "**no**", measured(case)]
                  for name, case in stage["cases"].items()])
    return out + [""]

