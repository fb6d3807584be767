"""Pipeline parallelism over any gpucoll ``Communicator`` (GPipe, 1F1B, interleaved 1F1B).

* :class:`Stage` - a list of layers, gradients summed over micro-batches, activations kept
  per micro-batch in flight (or recomputed).
* :class:`Pipeline` - one training step over M micro-batches, one rank per stage (or, with
  the interleaved schedule, ``v`` model chunks per rank): activations forward and gradients
  backward with ``isend`` / ``irecv``; the last stage's loss.
* :func:`schedule_actions`, :func:`timetable`, :func:`bubble_fraction` - the schedules
  (GPipe, 1F1B, interleaved 1F1B) as lists of actions.
* :func:`pipeline_groups` - pipelines x data-parallel replicas with two ``split`` calls.
* :class:`Linear`, :class:`ReLU`, :func:`mlp_layers` - plain layers that queue one saved
  input per forward; :func:`softmax_cross_entropy`.

Importing this package never imports CuPy.
"""

from .layers import Linear, ReLU, mlp_layers, softmax_cross_entropy
from .pipeline import Pipeline, pipeline_groups
from .schedule import SCHEDULES, bubble_fraction, peak_in_flight, schedule_actions, timetable
from .stage import Stage

__all__ = ["Stage", "Pipeline", "pipeline_groups", "SCHEDULES", "schedule_actions",
           "timetable", "bubble_fraction", "peak_in_flight", "Linear", "ReLU", "mlp_layers",
           "softmax_cross_entropy"]
