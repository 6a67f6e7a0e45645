"""`python -m zocheck_ray ...`: the `zocheck-ray` command line, wherever its console script is not on PATH.

    ray job submit --working-dir . --runtime-env deploy/runtime_env.yaml \
        -- python3 -m zocheck_ray train --config deploy/examples/sst2-opt.yaml

Started by a Python that lacks the dependencies (the system's `python3` on a node whose
`ray start` came from a virtual environment that is not activated), it says in one line
what to run instead, and exits with status 1.
"""

import sys

from zocheck_ray.cli import main

sys.exit(main())
