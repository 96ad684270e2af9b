"""``python -m sparkfleet.bench``: the benchmark clients without the controller's CLI."""

import sys

from sparkfleet.bench import main

sys.exit(main())
