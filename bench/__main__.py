import sys

from bench.commands import main

sys.exit(main())
