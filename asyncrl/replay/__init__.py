"""Replay for debugging: re-score, re-train and re-play what a run recorded (docs/REPLAY.md).

    asyncrl replay score RUN      recorded tokens re-scored under checkpoints: ratios, masks, drift
    asyncrl replay train RUN      a learner step re-run on exactly the batch it trained
    asyncrl replay episode RUN    an episode re-played with the recorded completions in place of the model
    asyncrl replay prune RUN      drop trajectories and checkpoints the run no longer needs

Every verb opens the run read-only (`run.RunView`) and writes only where it is told to.
"""
