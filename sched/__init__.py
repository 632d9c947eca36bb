"""The controller loop that owns stages, admission and heartbeats. Not built yet: see the learner/loop issue."""
