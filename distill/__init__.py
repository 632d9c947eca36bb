"""On-policy cross-stage distillation. Not built yet: see the pipeline issue."""
