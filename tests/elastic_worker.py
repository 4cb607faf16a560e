"""`relaytrain train` that also writes which global samples each rank read, for tests/test_elastic.py.

torchrun runs this file as each rank; every call of the train loader's `token_windows` (what
`next_batch` reads) appends `{"step", "first", "count"}` to `$ELASTIC_SAMPLE_LOG.<rank>`, then the
real CLI trains.
"""

from __future__ import annotations

import json
import os
import sys

from relaytrain.cli import main
from relaytrain.data.loader import TrainLoader

_read = TrainLoader.token_windows


def _recording(self, start, count):
    step = self.samples_consumed // self.global_batch_size + 1  # next_batch advances after reading
    path = f"{os.environ['ELASTIC_SAMPLE_LOG']}.{os.environ.get('RANK', '0')}"
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "first": int(start), "count": int(count)}) + "\n")
    return _read(self, start, count)


if __name__ == "__main__":
    TrainLoader.token_windows = _recording
    sys.exit(main(sys.argv[1:]))
