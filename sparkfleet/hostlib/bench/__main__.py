"""``python -m sparkfleet.hostlib.bench``: the benchmark clients without the controller's CLI."""

import sys

from sparkfleet.hostlib.bench import main

sys.exit(main())
