"""`python -m zocheck_ray ...`: the `zocheck-ray` command line, wherever its console script is not on PATH.

    ray job submit --working-dir . --runtime-env deploy/runtime_env.yaml \
        -- python3 -m zocheck_ray train --config deploy/examples/sst2-opt.yaml

Started by a Python that lacks the dependencies (a node's system `python3`), it says in one
line what to run instead and exits with status 1.
"""

import sys

from zocheck_ray.cli import main

sys.exit(main())
