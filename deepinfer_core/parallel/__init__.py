"""Running one model across ranks: expert placement (EPLB) and the per-expert load it plans from.

- :mod:`.eplb`: the pure planner (:func:`~.eplb.plan_placement`: hierarchical and global policies),
  the balance metric and the migration plan between two placements (docs/eplb.md).
- :mod:`.load`: :class:`~.load.ExpertLoadCounter`, routed tokens per expert counted on the device
  by the MoE layers (``ModelContext.expert_load``, engine option ``expert_load_window``).

Both import only torch (the bottom import layer), so the models can feed the counter.
"""

__all__: list[str] = []
