"""Pipeline schedules as plain lists of actions, one list per stage.

An action is ``("F", m)`` (forward of micro-batch ``m``) or ``("B", m)`` (its backward). With
``P`` stages and ``M`` micro-batches:

* **GPipe**: ``F0 .. F(M-1)``, then ``B0 .. B(M-1)``. Every stage holds all ``M``
  micro-batches' activations at its peak.
* **1F1B** (PipeDream-Flush): stage ``s`` runs ``w = min(P - 1 - s, M)`` warm-up forwards,
  then alternates one forward and one backward, then the ``w`` remaining backwards. It holds
  at most ``min(P - s, M)`` micro-batches' activations: the memory of GPipe with M = P.

Both run a stage's backwards in the order of its forwards, and both have the same idle time:
the bubble is ``(P - 1) / (M + P - 1)`` of a step when a forward and a backward take the same
time on every stage.
"""

from __future__ import annotations

from typing import List, Tuple

__all__ = ["SCHEDULES", "schedule_actions", "bubble_fraction", "peak_in_flight"]

SCHEDULES = ("gpipe", "1f1b")

Action = Tuple[str, int]


def _check(schedule: str, stage: int, stages: int, micro_batches: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")


def schedule_actions(schedule: str, stage: int, stages: int, micro_batches: int) -> List[Action]:
    """The actions stage ``stage`` of ``stages`` runs, in order, for one training step.

    Raises:
        ValueError: an unknown schedule, a stage outside [0, stages), M < 1.
    """
    _check(schedule, stage, stages, micro_batches)
    forwards = [("F", m) for m in range(micro_batches)]
    backwards = [("B", m) for m in range(micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(stages - 1 - stage, micro_batches)
    actions = forwards[:warmup]
    for m in range(micro_batches - warmup):
        actions += [forwards[warmup + m], backwards[m]]
    return actions + backwards[micro_batches - warmup:]


def peak_in_flight(actions: List[Action]) -> int:
    """The most micro-batches whose forward has run and backward has not, over ``actions``."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The textbook idle fraction of a synchronous pipeline step: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
