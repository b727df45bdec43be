"""Save phases: what a save does after :class:`~distckpt.Checkpointer` takes the call.

``phases`` runs them in order (validate and exchange views -> claim the step directory -> stage
-> write -> commit -> retention) and documents which ranks call each; ``assign`` decides who
writes what, ``planner`` is DCP's planner for it, ``metadata`` builds the global ``.metadata``,
``protocol`` drives DCP's protocol on distckpt's collectives (and caches plans between saves),
``writer`` and ``records`` turn a plan into checksummed files, ``staging`` copies state to host
memory for async saves, and ``background`` / ``shared_arena`` run those writes in a writer
process per rank fed through shared memory.
"""
