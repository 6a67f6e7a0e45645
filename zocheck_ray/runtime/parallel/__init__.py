"""Data parallel's parts: the shards of a step's batch and their exchange in shard order (`shards.py`), the ranks'
gloo group that exchanges them (`collective.py`), and the plans that re-form an elastic group (`elastic.py`)."""
