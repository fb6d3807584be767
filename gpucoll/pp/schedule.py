"""Pipeline schedules as plain lists of actions, one list per stage.

An action is ``("F", m)`` (forward of micro-batch ``m``) or ``("B", m)`` (its backward); in the
interleaved schedule it is ``("F", m, k)`` / ``("B", m, k)``, naming also the rank's model
chunk ``k``. With ``P`` stages and ``M`` micro-batches:

* **GPipe**: ``F0 .. F(M-1)``, then ``B0 .. B(M-1)``. Every stage holds all ``M``
  micro-batches' activations at its peak.
* **1F1B** (PipeDream-Flush): stage ``s`` runs ``w = min(P - 1 - s, M)`` warm-up forwards,
  then alternates one forward and one backward, then the ``w`` remaining backwards. It holds
  at most ``min(P - s, M)`` micro-batches' activations: the memory of GPipe with M = P.
* **Interleaved 1F1B** (Megatron-LM's virtual pipeline stages): the model is cut into
  ``P v`` chunks and rank ``r`` holds chunks ``r, r + P, ..., r + (v - 1) P`` (its chunks
  ``k = 0 .. v-1``). The rank runs ``v M`` chunk forwards in groups of ``P`` micro-batches:
  micro-batches ``0 .. P-1`` through chunk 0, the same through chunk 1, ..., chunk ``v - 1``,
  then micro-batches ``P .. 2P-1`` through chunk 0 again; its backwards go in the same order
  with the chunks reversed. Megatron's warm-up is ``w = min(2 (P - 1 - r) + (v - 1) P, v M)``
  forwards (all ``v M`` when ``M == P``), then one forward and one backward in turn, then the
  rest of the backwards. ``M`` must be a multiple of ``P``.

GPipe and 1F1B run a stage's backwards in the order of its forwards, the interleaved schedule
a chunk's backwards in the order of that chunk's forwards. Counting a chunk's forward and
backward as ``1 / v`` of a stage's, the idle time (bubble) is ``(P - 1) / (v M + P - 1)`` of a
step when every forward and backward take the same time: GPipe and 1F1B are ``v = 1``. The
interleaved schedule pays for the smaller bubble with more messages: ``2 M (P v - 1)`` a step
against ``2 M (P - 1)``, about ``v`` times as many.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

__all__ = ["SCHEDULES", "schedule_actions", "timetable", "bubble_fraction", "peak_in_flight"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")

Action = Union[Tuple[str, int], Tuple[str, int, int]]


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check(schedule: str, stage: int, stages: int, micro_batches: int,
           virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    _positive("stages", stages)
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage!r}")
    _positive("micro_batches", micro_batches)
    _positive("virtual_stages", virtual_stages)
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(f"schedule {schedule!r} runs one model chunk per stage, got "
                         f"virtual_stages={virtual_stages} (use schedule='interleaved')")
    if schedule == "interleaved" and micro_batches % stages:
        raise ValueError(f"the interleaved schedule needs micro_batches to be a multiple of "
                         f"the {stages} stages, got {micro_batches}")


def interleaved_warmup(stage: int, stages: int, micro_batches: int, virtual_stages: int) -> int:
    """Megatron's warm-up forwards of rank ``stage`` in the interleaved schedule:
    ``min(2 (P - 1 - r) + (v - 1) P, v M)``, or all ``v M`` when ``M == P``."""
    total = virtual_stages * micro_batches
    if micro_batches == stages:
        return total
    return min(2 * (stages - 1 - stage) + (virtual_stages - 1) * stages, total)


def _interleaved(stage: int, stages: int, micro_batches: int, virtual_stages: int):
    def nth(kind: str, index: int) -> Action:
        group, place = divmod(index, stages * virtual_stages)
        chunk = place // stages
        if kind == "B":
            chunk = virtual_stages - 1 - chunk
        return (kind, group * stages + place % stages, chunk)

    total = virtual_stages * micro_batches
    warmup = interleaved_warmup(stage, stages, micro_batches, virtual_stages)
    actions = [nth("F", index) for index in range(warmup)]
    for index in range(total - warmup):
        actions += [nth("F", warmup + index), nth("B", index)]
    return actions + [nth("B", index) for index in range(total - warmup, total)]


def schedule_actions(schedule: str, stage: int, stages: int, micro_batches: int,
                     virtual_stages: int = 1) -> List[Action]:
    """The actions stage ``stage`` of ``stages`` runs, in order, for one training step.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        stage, stages: this rank ``r`` and the pipeline's ranks ``P``.
        micro_batches: M >= 1 (a multiple of ``P`` for the interleaved schedule).
        virtual_stages: model chunks per rank ``v`` (the interleaved schedule only; 1 else).

    Returns:
        ``("F" | "B", m)`` for GPipe and 1F1B; ``("F" | "B", m, k)`` for the interleaved
        schedule, ``k`` the rank's chunk (the model's chunk ``k P + r``).

    Raises:
        ValueError: an unknown schedule, a stage outside [0, stages), M < 1, v < 1, v > 1
            with GPipe or 1F1B, an interleaved M that is not a multiple of P.
    """
    _check(schedule, stage, stages, micro_batches, virtual_stages)
    if schedule == "interleaved":
        return _interleaved(stage, stages, micro_batches, virtual_stages)
    forwards = [("F", m) for m in range(micro_batches)]
    backwards = [("B", m) for m in range(micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(stages - 1 - stage, micro_batches)
    actions = forwards[:warmup]
    for m in range(micro_batches - warmup):
        actions += [forwards[warmup + m], backwards[m]]
    return actions + backwards[micro_batches - warmup:]


def timetable(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1, *,
              training: bool = True) -> List[List[Optional[Action]]]:
    """Every stage's actions placed in unit time slots, each as early as its input allows.

    Each forward or backward takes one slot; what it sends can be used from the next slot on
    (a chunk's forward needs the previous chunk's forward of the micro-batch, a backward the
    next chunk's backward). Stages keep their order and idle (None) until their next action
    can run. ``training=False``: forwards only (evaluation).

    Returns:
        One list per stage, all of the same length ``T`` (``2 (v M + P - 1)`` for a training
        step): slot ``t`` of stage ``s`` is the action it runs then, or None.

    Raises:
        ValueError: as :func:`schedule_actions`.
    """
    lists = [schedule_actions(schedule, stage, stages, micro_batches, virtual_stages)
             for stage in range(stages)]
    if not training:
        lists = [[action for action in actions if action[0] == "F"] for actions in lists]
    last = stages * virtual_stages - 1
    ran_at: Dict[Tuple[str, int, int], int] = {}    # (kind, model chunk, m) -> its slot
    slots: List[List[Optional[Action]]] = [[] for _ in range(stages)]
    position = [0] * stages
    while any(position[stage] < len(lists[stage]) for stage in range(stages)):
        now, ran = len(slots[0]), []
        for stage in range(stages):
            action = lists[stage][position[stage]] if position[stage] < len(lists[stage]) \
                else None
            if action is not None:
                kind, m = action[0], action[1]
                chunk = (action[2] if len(action) > 2 else 0) * stages + stage
                need = (("F", chunk - 1, m) if kind == "F" and chunk > 0 else
                        ("B", chunk + 1, m) if kind == "B" and chunk < last else None)
                if need is not None and ran_at.get(need, now) >= now:
                    action = None
            slots[stage].append(action)
            if action is not None:
                ran.append((stage, chunk, action))
        if not ran:
            raise RuntimeError(f"{schedule}: no stage can run at slot {now} (a bug)")
        for stage, chunk, action in ran:
            ran_at[(action[0], chunk, action[1])] = now
            position[stage] += 1
    return slots


def peak_in_flight(actions: List[Action]) -> int:
    """The most forwards whose backward has not run yet, over ``actions``.

    GPipe: ``M``; 1F1B: ``min(P - s, M)`` micro-batches. Interleaved: ``min(w + 1, v M)``
    (micro-batch, chunk) pairs, ``w`` the warm-up (``v M`` when ``M == P``), each about
    ``1 / v`` of a stage's activations: with ``M > P`` rank 0 holds ``P + (P - 1) / v``
    micro-batches' worth of a whole stage, against ``P`` in 1F1B.
    """
    held = peak = 0
    for kind, *_ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The textbook idle fraction of a synchronous pipeline step: ``(P - 1) / (v M + P - 1)``
    (``v = 1``: GPipe and 1F1B, ``(P - 1) / (M + P - 1)``)."""
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)
