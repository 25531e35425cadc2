"""The GPU clock: minienv's real engine (scheduler, paged KV manager, prefix cache) run at the scale of a real
deployment, each step timed by a roofline model of a named GPU.

No GPU and no arithmetic: a :class:`~minienv.sim.simulated_model.SimulatedModel` emits each request's trace
output length and stops; the KV budget is what the GPU has left after the weights, in blocks of the real
manager. What the clock charges for a step comes from the shape the real scheduler built
(:mod:`minienv.sim.roofline`). ``python -m minienv simulate`` is the command line (:mod:`minienv.sim.cli`).

Modules, one job each: ``hardware`` (GPU datasheets, cited), ``models`` (model shapes), ``roofline`` (a step's
FLOPs and bytes -> seconds, and the KV budget), ``workloads`` (seeded synthetic traces), ``simulated_model``
(the no-math model and tokenizer), ``reservation`` (the Orca-style reservation baselines as a KV manager),
``run`` (drive the engine on a virtual clock, vLLM's benchmark metrics).
"""

from minienv.sim.hardware import GPUS, GPUSpec, get_gpu
from minienv.sim.models import MODELS, ModelSpec, get_model
from minienv.sim.roofline import ModelDoesNotFitError, RooflineClock, StepCost

__all__ = ["GPUS", "GPUSpec", "get_gpu", "MODELS", "ModelSpec", "get_model", "RooflineClock", "StepCost",
           "ModelDoesNotFitError"]
