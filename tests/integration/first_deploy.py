"""The sandbox fleet's first deploy, run ahead of the integration tests and recorded for them.

``make test`` runs it beside the vLLM tests (the deploy is mostly pip and the hosts' vLLM starts, the
vLLM tests one engine at a time: on two cores the pair takes less than the two in a row), then the
integration tests with ``SPARKFLEET_FIRST_DEPLOY`` naming the record: the ``converged_fleet``
fixture takes this run as the session's deploy when every host still holds the state it left,
instead of deploying again. Without the variable, or with a record the hosts no longer match, the
fixture deploys itself, as before.

    python -m tests.integration.first_deploy --out build/sandbox/first-deploy.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.integration.conftest import FIRST_DEPLOY_PLAY, host_fingerprints, run_playbook
from tests.sandbox import fleet
from tests.sandbox.conftest import SandboxFleet, read_inventory_hosts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the record goes (JSON)")
    args = parser.parse_args(argv)
    args.out.unlink(missing_ok=True)
    hosts = SandboxFleet(read_inventory_hosts(fleet.INVENTORY_FILE), fleet.INVENTORY_FILE)
    run = run_playbook(*FIRST_DEPLOY_PLAY)
    record = {
        "play": list(FIRST_DEPLOY_PLAY),
        "returncode": run.returncode,
        "output": run.output,
        "recap": run.recap,
        "hosts": host_fingerprints(hosts),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(f".{args.out.name}.part")
    partial.write_text(json.dumps(record), encoding="utf-8")
    partial.replace(args.out)
    print(f"first deploy: rc {run.returncode}, recorded in {args.out} for the integration tests")
    return 0  # the tests judge the run (its failure is theirs to report, with its output)


if __name__ == "__main__":
    sys.exit(main())
