"""Load phases: plan what each rank asks for -> judge what does not match -> read -> apply.

``phases`` holds the phases and their typed report, ``planner`` the DCP load planner that checks
non-tensor items before unpickling, and ``reader`` the DCP storage reader that reads each byte
once into its destination through :mod:`distckpt.integrity.stepfiles`; ``verify`` the state
check after a load (verified resume) with O(keys) bytes per rank.
"""
