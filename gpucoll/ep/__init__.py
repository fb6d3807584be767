"""Expert parallelism over any gpucoll ``Communicator``: a mixture-of-experts layer whose
experts are spread over the group, tokens routed to them with ``all_to_all_v``.

* :class:`MoELayer` - top-1 gating (replicated gate), each rank holding ``experts_per_rank``
  two-layer ReLU experts; forward and backward with the array module.
* :func:`init_experts` - every expert's parameters, identical on every rank per seed.

Importing this package never imports CuPy.
"""

from .moe import MoELayer, init_experts

__all__ = ["MoELayer", "init_experts"]
