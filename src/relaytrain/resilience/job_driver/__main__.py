import sys

from relaytrain.resilience.batch.driver import main

sys.exit(main())
