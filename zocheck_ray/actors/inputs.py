"""`InputsActor`: the rows and functions a run's trainers take from the driver besides the job (the start-up
check's task, a `model_init`), kept in Ray's object store.

Each trainer process, restarted ones too, finds the holder by name, since Ray cannot promise a restartable actor the
references it was created with (ray-project/ray#53727). The holder is never restarted and lives on the driver's node.
"""

from __future__ import annotations

import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from zocheck_ray.actors.names import NAMESPACE


@ray.remote(num_cpus=0, max_restarts=0)
class InputsActor:
    def __init__(self, inputs: list):
        self._inputs = inputs

    def get(self) -> list:
        """[the task's reference, the model_init's reference or None]."""
        return self._inputs


def hold_inputs(run_id: str, task, model_init=None) -> tuple[str, object]:
    """(name, handle) of a new holder of `task` and `model_init`, on this process's node."""
    name = f"zocheck-inputs-{run_id}-{uuid.uuid4().hex[:8]}"
    refs = [ray.put(task), ray.put(model_init) if model_init is not None else None]
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return name, InputsActor.options(name=name, namespace=NAMESPACE, scheduling_strategy=here).remote(refs)


def take_inputs(name: str) -> tuple[object, object]:
    """(task, model_init or None) held under `name`."""
    task_ref, init_ref = ray.get(ray.get_actor(name, namespace=NAMESPACE).get.remote())
    return ray.get(task_ref), ray.get(init_ref) if init_ref is not None else None
