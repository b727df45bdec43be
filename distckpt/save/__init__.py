"""Save phases: what a save does after :class:`~distckpt.Checkpointer` takes the call.

``phases`` runs them in order (validate and exchange views -> claim the step directory -> plan
-> write -> commit -> retention) and documents which ranks call each; ``plan`` decides who
writes what (and caches the plan between saves), ``writer`` turns a plan into checksummed
files, ``staging`` copies state to host memory for async saves, and ``background`` /
``shared_arena`` run those writes in a writer process per rank fed through shared memory.
"""
