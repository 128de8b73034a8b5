"""Running one model across ranks: expert placement (EPLB) and the per-expert load it plans from.

- :mod:`.eplb`: the pure planner (:func:`~.eplb.plan_placement`), the balance metric and the
  migration plan between two placements.
"""

__all__: list[str] = []
