import sys

from relaytrain.entry_points import OLD_STEP_END
from relaytrain.resilience.batch.step_end import main

sys.exit(main(prog=f"python -m {OLD_STEP_END}"))
