import sys

from lingpack.plan.cli import main

sys.exit(main())
