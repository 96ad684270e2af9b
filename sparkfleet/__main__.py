import sys

from sparkfleet.cli import main

sys.exit(main())
